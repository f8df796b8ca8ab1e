#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, the client tools) and munge for the loopback Slurm tests. The tests
# write their own slurm.conf and munge key and start the daemons themselves; scripts/apt-install.sh says what it
# installs and upgrades first, and leaves no daemon running or enabled at boot.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
  && command -v munged >/dev/null; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "Slurm not installed and cannot install it here (needs root and apt-get): Slurm tests will be skipped" >&2
  exit 0
fi
scripts/apt-install.sh "the Slurm tests run a one-node cluster on loopback (Debian's slurm-wlm and munge)" \
  slurm-wlm munge || echo "slurm-wlm/munge install failed: Slurm tests will be skipped" >&2
