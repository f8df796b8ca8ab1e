#!/usr/bin/env bash
# Installs Debian's OpenSSH server binary for the loopback SSH tests (the tests start their own sshd, on a free port
# of 127.0.0.1 with their own config and keys); scripts/apt-install.sh says what it installs and upgrades first, and
# leaves no sshd running or enabled at boot.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x /usr/sbin/sshd ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "sshd not installed and cannot install it here: OpenSSH tests will be skipped" >&2
  exit 0
fi
# openssh-client is named because openssh-server needs the very same version: apt would upgrade it anyway
scripts/apt-install.sh "the loopback SSH tests run Debian's sshd (OpenSSH server)" openssh-server openssh-client \
  || echo "openssh-server install failed: OpenSSH tests will be skipped" >&2
