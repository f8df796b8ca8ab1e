#!/usr/bin/env bash
# Installs Debian packages for the tests with apt-get, system-wide. Before it does, it says on stderr why, what it
# installs and what it upgrades in place (apt's own plan, `apt-get install -s`). The daemons those packages bring
# are neither started (policy-rc.d) nor left enabled at boot: the tests start their own, each with its own config,
# from the binaries, so whatever the packages' scripts enable at boot (systemd units, SysV rc links) that was not
# enabled before is disabled again, and said so.
# Usage: scripts/apt-install.sh WHY PACKAGE...   (root with apt-get: the callers check, and say what is skipped)
set -euo pipefail
why="$1"
shift
say() { echo "apt-install: $*" >&2; }
units="${AXRL_SYSTEMD_DIR:-/etc/systemd/system}"  # other roots for the script's own test
rc="${AXRL_RC_DIR:-/etc}"
policy="${AXRL_POLICY_RC:-/usr/sbin/policy-rc.d}"
export DEBIAN_FRONTEND=noninteractive

boot_links() {  # every unit or SysV script enabled at boot, one per line (none where a directory is missing)
  { find "$units" -path '*.wants/*' -type l 2>/dev/null || true
    find "$rc"/rc?.d -name 'S*' -type l 2>/dev/null || true; } | sort
}

say "$why"
apt-get update -qq >&2
plan=$(apt-get install -s --no-install-recommends "$@" 2>/dev/null | grep '^Inst ' || true)
new=$(awk '$3 !~ /^\[/ {print $2}' <<<"$plan" | paste -sd' ' -)
upgraded=$(awk '$3 ~ /^\[/ {gsub(/[][(]/, "", $3); gsub(/[(]/, "", $4); print $2 " " $3 " -> " $4}' <<<"$plan" \
  | paste -sd, - | sed 's/,/, /g')
say "installing with apt-get, system-wide: ${new:-nothing new}"
if [ -n "$upgraded" ]; then
  say "upgrading in place: $upgraded (the packages above depend on these versions)"
fi
say "their daemons are not started, and not left enabled at boot: the tests start their own"
before=$(boot_links)
if [ ! -e "$policy" ]; then  # invoke-rc.d asks it: 101 = action forbidden, so no postinst starts a daemon
  trap 'rm -f "$policy"' EXIT
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy"
fi
apt-get install -y -qq --no-install-recommends "$@" >&2
disabled=()
while IFS= read -r link; do
  [ -n "$link" ] || continue
  case "$link" in
    "$units"/*) name=$(basename "$link"); deb-systemd-helper disable "$name" >/dev/null 2>&1 || rm -f "$link" ;;
    *) name=$(basename "$link" | sed 's/^S[0-9]*//'); update-rc.d "$name" disable >/dev/null 2>&1 || rm -f "$link" ;;
  esac
  disabled+=("$name")
done < <(comm -13 <(echo "$before") <(boot_links))
if [ ${#disabled[@]} -gt 0 ]; then
  say "not enabled at boot (the packages' scripts had enabled them): $(printf '%s\n' "${disabled[@]}" | sort -u | paste -sd' ' -)"
fi
