#!/usr/bin/env bash
# Installs Debian's OpenSSH server binary for the loopback SSH tests (the tests start their own sshd).
set -euo pipefail
if [ -x /usr/sbin/sshd ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "sshd not installed and cannot install it here: OpenSSH tests will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2 && apt-get install -y -qq --no-install-recommends openssh-server openssh-client >&2 \
  || echo "openssh-server install failed: OpenSSH tests will be skipped" >&2
