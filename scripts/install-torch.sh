#!/usr/bin/env bash
# Installs torch into the virtual environment whose python is $1, and says on stderr which build and from where.
#
# PyPI's Linux torch wheel is the CUDA build: with its nvidia-* packages several GB, useless without an NVIDIA GPU.
# So on a machine with no NVIDIA GPU (no nvidia-smi, no /dev/nvidia<N>) torch comes from PyTorch's own CPU wheel
# index (~200 MB), when that index answers within a few seconds; otherwise, and on a GPU machine, from the
# configured index (PyPI, plus any find-links or extra index pip is configured with, which may hold a CPU wheel).
#
# Settings (environment): AXRL_TORCH_VERSION (default 2.13.0), AXRL_TORCH_CPU_INDEX (default PyTorch's CPU index),
# AXRL_TORCH_INDEX_TIMEOUT (seconds, default 5), AXRL_DEV_DIR (where to look for nvidia device files, default /dev).
set -euo pipefail
PY=${1:?usage: install-torch.sh VENV_PYTHON}
VERSION=${AXRL_TORCH_VERSION:-2.13.0}
INDEX=${AXRL_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
TIMEOUT=${AXRL_TORCH_INDEX_TIMEOUT:-5}
DEV=${AXRL_DEV_DIR:-/dev}
say() { echo "setup: $*" >&2; }

gpu() {  # prints what shows an NVIDIA GPU here, or fails
  if command -v nvidia-smi >/dev/null 2>&1; then echo "nvidia-smi is installed"; return 0; fi
  local dev
  for dev in "$DEV"/nvidia[0-9]*; do
    if [ -e "$dev" ]; then echo "$dev exists"; return 0; fi
  done
  return 1
}

unreachable() {  # prints why the index cannot be reached, or fails when it answers
  "$PY" - "$INDEX" "$TIMEOUT" <<'PY'
import sys
import urllib.request

url, timeout = sys.argv[1].rstrip("/") + "/torch/", float(sys.argv[2])
try:
    urllib.request.urlopen(url, timeout=timeout).close()
except Exception as exc:  # DNS, refused, timeout, TLS, HTTP error: all mean "not from there"
    print(f"{type(exc).__name__}: {exc}"[:200])
    sys.exit(0)
sys.exit(1)
PY
}

if why=$(gpu); then
  say "an NVIDIA GPU is here ($why): installing torch==$VERSION from the configured index (PyPI: the CUDA build)"
  "$PY" -m pip install -q "torch==$VERSION" >&2
elif ! why=$(unreachable); then
  say "no NVIDIA GPU here: installing torch==$VERSION, the CPU build (~200 MB), from PyTorch's CPU wheel index $INDEX"
  "$PY" -m pip install -q --index-url "$INDEX" "torch==$VERSION" >&2
else
  say "no NVIDIA GPU here, but PyTorch's CPU wheel index $INDEX cannot be reached within ${TIMEOUT} s ($why):" \
    "installing torch==$VERSION from the configured index instead (PyPI's Linux wheel is the CUDA build, several GB," \
    "unless pip finds a CPU wheel in its find-links or extra index)"
  "$PY" -m pip install -q "torch==$VERSION" >&2
fi
say "installed torch $("$PY" -W ignore -c 'import torch; print(torch.__version__)' 2>/dev/null)"
