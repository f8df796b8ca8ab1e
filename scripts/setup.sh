#!/usr/bin/env bash
# Creates .venv with torch (the CPU build on a machine without an NVIDIA GPU: scripts/install-torch.sh) when none is
# importable, and the package with its dev extras.
# Idempotent and quick when nothing changed: a stamp keyed on pyproject.toml skips the pip work.
# Says what it installs and why on stderr (stdout stays for the command that follows).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${AXRL_VENV:-.venv}"
say() { echo "setup: $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV with $("$PY" --version 2>&1)"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.axrl-setup-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  start=$SECONDS
  say "first run (or pyproject.toml changed): installing packages; about 2-5 minutes on a small machine"
  say "upgrading pip"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # Replays recompute gradients with torch. PyPI's Linux wheel is the multi-GB CUDA build: without an NVIDIA GPU
  # the CPU build comes from PyTorch's own index (scripts/install-torch.sh says which it did, and why).
  if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    say "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') is already importable: kept"
  else
    scripts/install-torch.sh "$VENV/bin/python"
  fi
  say "installing axrl-spike-replay (editable) with its dependencies and dev tools (pytest with pytest-xdist, ruff, hypothesis, ...)"
  "$VENV/bin/python" -m pip install -q -e ".[dev]" >&2
  rm -f "$VENV"/.axrl-setup-*
  touch "$stamp"
  say "done in $((SECONDS - start)) s"
fi
# Checked on every run (not only when pyproject.toml changes), so an existing .venv gets it too.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('verl') is None)"; then
  say "installing verl==0.9.1 --no-deps: the tests check our verl loss convention against verl's own loss functions (its source only; none of its heavy dependencies)"
  "$VENV/bin/python" -m pip install -q --no-deps "verl==0.9.1" >&2
fi
# verl's ppo_loss takes a TensorDict: the cross-check runs it from verl's own file. tensordict is pure Python;
# --no-deps with its two small dependencies pinned, so no resolver step can swap the pinned CPU torch.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensordict') is None)"; then
  say "installing tensordict==0.15.3 (with cloudpickle, pyvers) --no-deps: verl's ppo_loss, run by the verl cross-check, takes a TensorDict"
  "$VENV/bin/python" -m pip install -q --no-deps "tensordict==0.15.3" "cloudpickle==3.1.3" "pyvers==0.2.3" >&2
fi
# megatron-core for the Megatron routes' tests (tests/megatron): --no-deps, since its extras pull CUDA packages;
# its real dependencies (torch, numpy, packaging) are here already, psutil (used, undeclared) and einops (mbridge's)
# are pinned beside it, so no resolver step can swap the pinned CPU torch. 0.16.1 is the last release for Python
# 3.11; newer Pythons take the newest. Where it cannot be installed the Megatron tests skip and say why.
if ! "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('megatron') is None or importlib.util.find_spec('mbridge') is None)"; then
  if "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then mcore="megatron-core==0.16.1"; else mcore="megatron-core"; fi
  say "installing $mcore, mbridge==0.15.1 (with psutil, einops) --no-deps: the Megatron tests save, load and run Megatron-core's own GPTModel on CPU"
  "$VENV/bin/python" -m pip install -q --no-deps "$mcore" "mbridge==0.15.1" "psutil==7.2.2" "einops==0.8.1" >&2 \
    || say "megatron-core could not be installed: the Megatron tests will skip"
fi
