"""verl 0.9.1's `FSDPEngine.optimizer_step` as the shipped patch verl-0.9.1.diff patches it, run from the patched file.

The engine itself cannot be built here (ray, GPUs, its process groups), so the method is taken from the patched
`transformer_impl.py` (its source, compiled as is) and bound to a stand-in object that carries what it reads:
`module`, `optimizer`, `optimizer_config.clip_grad`, `scaler` (verl's ShardedGradScaler under fp16),
`_qat_enabled`, and what the patch's `forward_backward_batch` keeps (`_axrl_spike_batch`, `_axrl_spike_loss_fn`).
Its `from verl.utils.axrl_spike_hook import guard_step` reaches the patched shim file, loaded by path;
`fsdp2_clip_grad_norm_` is verl's own from `verl/utils/fsdp_utils.py`, with `get_device_id` standing in for
verl's device lookup (this machine has no GPU: the CPU). Everything else the method names is torch's own.
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

from axrl_spike_replay.integrations import VERL_PATCH

REPO = Path(__file__).resolve().parents[2]
DIFF = VERL_PATCH  # shipped in the package: axrl_spike_replay/integrations/verl-0.9.1.diff
HOOK = VERL_PATCH.with_name("verl.py")
PATCHED_FILES = (
    Path("verl/workers/engine/fsdp/transformer_impl.py"),
    Path("verl/trainer/ppo/ray_trainer.py"),
    Path("verl/trainer/ppo/v1/trainer_base.py"),
)
SHIM = Path("verl/utils/axrl_spike_hook.py")


def verl_root() -> Path | None:
    """The installed verl package dir (found without executing its `__init__`, which imports ray), else None."""
    spec = importlib.util.find_spec("verl")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def patched_tree(dest: Path) -> Path:
    """A git tree holding the installed verl's files the diff touches, with the diff applied (`git apply --check`
    first, as the README says)."""
    root = verl_root()
    assert root is not None, "verl is not installed"
    for rel in PATCHED_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root.parent / rel, dest / rel)
    (dest / SHIM.parent).mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "apply", "--check", str(DIFF)], cwd=dest, check=True)
    subprocess.run(["git", "apply", str(DIFF)], cwd=dest, check=True)
    return dest


def _function(path: Path, name: str, owner: str | None, namespace: dict[str, Any]) -> Any:
    """Function `name` (a method of class `owner`) compiled from `path`'s source into `namespace`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    scope: list[ast.stmt] = tree.body
    if owner is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # the file's own code, line numbers kept
    return namespace[name]


def load_shim(tree: Path) -> types.ModuleType:
    """The patched `verl.utils.axrl_spike_hook`, registered under its name with stand-in parent packages (verl's
    own `__init__` imports ray): what the method's function-level import then finds."""
    for package in ("verl", "verl.utils"):
        sys.modules.setdefault(package, types.ModuleType(package))
    spec = importlib.util.spec_from_file_location("verl.utils.axrl_spike_hook", tree / SHIM)
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    sys.modules["verl.utils.axrl_spike_hook"] = shim
    spec.loader.exec_module(shim)
    return shim


def optimizer_step(tree: Path) -> Any:
    """The patched `FSDPEngine.optimizer_step` (unbound): call it as `optimizer_step(engine)`."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor import DTensor

    root = verl_root()
    assert root is not None
    clip = _function(root / "utils" / "fsdp_utils.py", "fsdp2_clip_grad_norm_", None, {"torch": torch})
    clip.__globals__["get_device_id"] = lambda: "cpu"
    namespace = {"torch": torch, "FSDP": FSDP, "FSDPModule": FSDPModule, "DTensor": DTensor}
    namespace["fsdp2_clip_grad_norm_"] = clip
    load_shim(tree)
    return _function(tree / PATCHED_FILES[0], "optimizer_step", "FSDPEngine", namespace)
