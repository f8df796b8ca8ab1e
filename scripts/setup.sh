#!/usr/bin/env bash
# Creates .venv with a CPU torch (when none is importable) and the package with its dev extras.
# Idempotent and quick when nothing changed: a stamp keyed on pyproject.toml skips the pip work.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${AXRL_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.axrl-setup-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # An unpinned torch would pull a multi-GB CUDA build; the CPU build is pinned where none exists.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e ".[dev]" >&2
  rm -f "$VENV"/.axrl-setup-*
  touch "$stamp"
fi
