#!/usr/bin/env bash
# Sets everything up, then runs the lint, the type checker and the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/sshd-install.sh
scripts/inspector-install.sh
scripts/slurm-install.sh
.venv/bin/ruff check .
.venv/bin/pyright --pythonpath .venv/bin/python  # the library, as configured in pyproject.toml
exec .venv/bin/python -m pytest "$@"
