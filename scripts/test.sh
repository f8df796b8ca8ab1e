#!/usr/bin/env bash
# Sets everything up, then runs the lint and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/sshd-install.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
