#!/usr/bin/env bash
# Sets everything up, then runs the demo on a freshly captured spike. Extra arguments go to `demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/axrl-spike-replay demo "$@"
