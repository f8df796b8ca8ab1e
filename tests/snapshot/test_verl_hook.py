"""The verl spike hook: the documented patch applies to verl 0.9.1's installed files and they still compile.

the shipped patch verl-0.9.1.diff puts the spike guard into the FSDP engine's `optimizer_step` (after the
pre-clip norm, before `optimizer.step()`) and keeps each rank's mini-batch from `forward_backward_batch`;
axrl_spike_replay/integrations/verl.py, loaded by path as the patch does, needs neither verl nor its dependencies.
"""

from __future__ import annotations

import importlib.util
import py_compile
import shutil
from pathlib import Path

import pytest
import torch
from verl_engine_step import PATCHED_FILES, SHIM, patched_tree

from axrl_spike_replay.integrations import VERL_PATCH

VERL_HOOK_FILE = VERL_PATCH.with_name("verl.py")  # the hook shipped in the package, loaded by path as a copy
_VERL_SPEC = importlib.util.find_spec("verl")
VERL = Path(_VERL_SPEC.origin).parent if _VERL_SPEC and _VERL_SPEC.origin else None
ENGINE = Path("verl/workers/engine/fsdp/transformer_impl.py")


@pytest.mark.skipif(VERL is None or shutil.which("git") is None, reason="needs verl 0.9.1 installed and git")
def test_the_patch_applies_to_the_installed_verl_and_the_modules_compile(tmp_path: Path) -> None:
    assert VERL is not None
    assert (VERL / "version" / "version").read_text(encoding="utf-8").strip() == "0.9.1"
    tree = patched_tree(tmp_path / "src")  # git apply --check, then git apply, on the installed files
    for module in (*PATCHED_FILES, SHIM):
        py_compile.compile(str(tree / module), doraise=True)
    patched = (tree / ENGINE).read_text(encoding="utf-8")
    hook, step = patched.index("guard_step(self, grad_norm)"), patched.index("self.optimizer.step()")
    assert patched.index("def optimizer_step") < hook < step  # the norm is judged before the update
    kept = patched.index("self._axrl_spike_loss_fn = loss_function")  # the loss settings the snapshot records
    assert patched.index("def forward_backward_batch") < kept < patched.index("def optimizer_step")
    for trainer in PATCHED_FILES[1:]:  # both PPO trainers put their global step on the batch update_actor gets
        text = (tree / trainer).read_text(encoding="utf-8")
        update = text.index("def _update_actor")
        assert update < text.index("global_steps", update) < text.index("self.actor_rollout_wg.update_actor", update)


def _load_hook():
    spec = importlib.util.spec_from_file_location("axrl_verl_hook", VERL_HOOK_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_loads_by_path_and_keeps_verl_s_key_names() -> None:
    hook = _load_hook()
    values = torch.arange(7)
    batch = {
        "input_ids": torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 3, 7])),
        "response_mask": torch.ones(2, 2),
        "old_log_probs": torch.zeros(2, 2),
        "advantages": torch.ones(2, 2),
        "dp_size": 2,
        "batch_num_tokens": 4,
    }
    payload = hook.batch_payload(batch)
    assert set(payload) == {"input_ids", "response_mask", "old_log_probs", "advantages", "dp_size", "batch_num_tokens"}
    assert payload["input_ids"].is_nested and int(payload["dp_size"]) == 2
    config = hook.run_config(2)
    assert config["loss"]["convention"] == "verl"
    assert config["parallel"]["strategy"] == "fsdp" and config["train"]["verl_version"] == "0.9.1"
