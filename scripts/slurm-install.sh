#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, the client tools) and munge for the loopback Slurm tests. The
# tests write their own slurm.conf and munge key and start the daemons themselves; nothing is enabled here.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
  && command -v munged >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "Slurm not installed and cannot install it here (needs root and apt-get): Slurm tests will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# No init system runs in a container: keep the packages' scripts from starting the daemons they install.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  trap 'rm -f "$policy"' EXIT
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
fi
apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends slurm-wlm munge >&2 \
  || echo "slurm-wlm/munge install failed: Slurm tests will be skipped" >&2
