"""verl 0.9.1's own loss functions, loaded from the installed verl files for the cross-check.

verl is installed with --no-deps, and tensordict (pure Python) beside it: scripts/setup.sh installs both.
`import verl.workers.utils.losses` still fails, on ray: verl's package `__init__` imports `verl.protocol`
(`import ray`), and `losses.py` -> `core_algos.py` -> `verl.workers.config` -> `actor.py` ->
`verl.utils.profiler` -> `profile.py` -> `verl.single_controller` -> `base/worker.py` imports ray too
(a 79 MB wheel, with omegaconf, codetiming and orjson needed on the way). So the real files are executed
by importlib under minimal stand-in modules for exactly the imports that are unavailable or would pull
ray in: verl's package `__init__`s, omegaconf, `verl.utils.device`, the config classes, `DataProto`.
Every function the test calls — `ppo_loss` (with `no_padding_2_padding`, `tensordict_utils`, the
`Metric` class and tensordict's own `TensorDict` it uses), `agg_loss`, `compute_policy_loss_vanilla` (and the
`gspo`, `cispo` and `sapo` policy losses `ppo_loss` dispatches to by `policy_loss.loss_mode`),
`kl_penalty`, `compute_rollout_correction_weights`, `compute_rollout_rejection_mask`,
`compute_grpo_outcome_advantage`, and verl_F's `masked_sum` / `masked_mean` — is verl's code as
installed. The one stand-in that is used is the actor config `ppo_loss` reads (`ActorConfigStandIn`, also the
`ActorConfig` class the policy losses check their config against): verl's `ActorConfig` is a dataclass behind that
ray import chain, and the loss reads only its fields.
Other stand-ins raise if anything calls into them. `sys.modules` is restored afterwards: the loaded
functions keep their own module globals.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any


class _Unavailable:
    """A name a stand-in module exports; the tested functions never use it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a verl stand-in was called: the cross-check reached code it does not load")


def _passthrough_decorator(*args: Any, **kwargs: Any) -> Any:
    def wrap(fn: Any) -> Any:
        return fn

    return wrap


def missing() -> str | None:
    """Why verl's own loss cannot be run here (a package not installed), else None."""
    for name, what in (("verl", "verl==0.9.1 --no-deps"), ("tensordict", "tensordict 0.15.3 --no-deps")):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or half-removed install: as good as missing
            found = False
        if not found:
            return f"{name} is not installed (scripts/setup.sh installs {what}); the verl cross-check needs it"
    return None


def skip_unless_installed() -> None:
    """Skip the calling test (pytest) with the reason when verl or tensordict is missing."""
    import pytest

    reason = missing()
    if reason is not None:
        pytest.skip(reason)


def verl_dir() -> Path:
    spec = importlib.util.find_spec("verl")  # finds the package without executing its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("verl is not installed (scripts/setup.sh installs verl==0.9.1 --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def load_verl() -> dict[str, Any]:
    """{"core_algos", "rollout_corr", "losses", "seqlen_balancing", "engine_utils": modules, "version": str},
    executed from the installed files."""
    # imported before the snapshot of sys.modules below: the test builds its TensorDicts with this copy
    if importlib.util.find_spec("tensordict") is None:
        raise ModuleNotFoundError("tensordict is not installed (scripts/setup.sh installs it, 0.15.3 --no-deps)")
    import tensordict  # noqa: F401

    root = verl_dir()
    saved = dict(sys.modules)

    def package(name: str, path: Path | None = None, **attrs: Any) -> types.ModuleType:
        module = types.ModuleType(name)
        if path is not None:
            module.__path__ = [str(path)]  # submodules load from the real files
        for key, value in attrs.items():
            setattr(module, key, value)
        sys.modules[name] = module
        return module

    def load(name: str, relpath: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(name, root / relpath)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    try:
        # unavailable third-party package (core_algos names DictConfig in an isinstance check it never reaches)
        package("omegaconf", DictConfig=_Unavailable, open_dict=_Unavailable)
        # verl's packages, without their __init__ (which import ray and the config machinery)
        package("verl", root)
        package("verl.utils", root / "utils", as_torch_index=_Unavailable, group_mean_std=_Unavailable)
        package(
            "verl.utils.device",
            get_device_name=_Unavailable,  # seqlen_balancing asks for it only under torch.distributed
            get_torch_device=_Unavailable,
            is_npu_available=False,
            manual_seed=_Unavailable,
            manual_seed_all=_Unavailable,
        )
        package("verl.trainer", root / "trainer")
        package("verl.trainer.ppo", root / "trainer" / "ppo")
        package("verl.trainer.config", root / "trainer" / "config", AlgoConfig=type("AlgoConfig", (), {}))
        package("verl.trainer.config.algorithm", RolloutCorrectionConfig=_Unavailable)
        package("verl.workers", root / "workers")
        # the actor config's class is the stand-in: verl's gspo, cispo and sapo losses assert isinstance(config, it)
        config = root / "workers" / "config"
        package("verl.workers.config", config, ActorConfig=ActorConfigStandIn, CriticConfig=_Unavailable)
        # verl.utils.dataset's __init__ loads the RL datasets (and `datasets`); losses.py needs only dataset_utils
        package("verl.utils.dataset", root / "utils" / "dataset")
        package("verl.workers.config.actor", PolicyLossConfig=_Unavailable)
        package("verl.protocol", DataProto=_Unavailable)
        # `deprecated` only wraps the legacy compute_policy_loss with a warning
        package("verl.utils.import_utils", deprecated=_passthrough_decorator)
        load("verl.utils.torch_functional", "utils/torch_functional.py")
        core_algos = load("verl.trainer.ppo.core_algos", "trainer/ppo/core_algos.py")
        rollout_corr = load("verl.trainer.ppo.rollout_corr_helper", "trainer/ppo/rollout_corr_helper.py")
        # its own imports (tensordict_utils, metric, dataset_utils, padding) load from verl's files
        losses = load("verl.workers.utils.losses", "workers/utils/losses.py")
        # the engines' micro-batch split (`prepare_micro_batches`, `rearrange_micro_batches`); the engine package's
        # own __init__ registers every backend, so only its utils module is loaded
        package("verl.workers.engine", root / "workers" / "engine")
        seqlen = load("verl.utils.seqlen_balancing", "utils/seqlen_balancing.py")
        engine_utils = load("verl.workers.engine.utils", "workers/engine/utils.py")
        version = (root / "version" / "version").read_text(encoding="utf-8").strip()
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    return {
        "core_algos": core_algos,
        "rollout_corr": rollout_corr,
        "losses": losses,
        "seqlen_balancing": seqlen,
        "engine_utils": engine_utils,
        "version": version,
    }


class ActorConfigStandIn(dict):
    """The fields of verl's `ActorConfig` that `ppo_loss` and `compute_policy_loss_vanilla` read, nothing else.

    `ActorConfig` is a dict-like dataclass (the policy loss calls `config.get("clip_ratio_c", 3.0)`), so the
    stand-in is a dict holding `clip_ratio_c` with the other fields as attributes. `ppo_loss` writes the
    step's counts into `global_batch_info`: one stand-in per call. KL off leaves verl's defaults for its type
    and coefficient, which the loss then never reads.
    """

    def __init__(
        self,
        *,
        clip_low: float,
        clip_high: float,
        clip_ratio_c: float,
        loss_agg_mode: str,
        loss_scale_factor: float | None = None,
        entropy_coeff: float = 0.0,
        kl: tuple[str, float] | None = None,
        loss_mode: str = "vanilla",
        taus: tuple[float, float] = (1.0, 1.05),
    ) -> None:
        super().__init__(clip_ratio_c=clip_ratio_c)
        self.clip_ratio = clip_low
        self.clip_ratio_low = clip_low
        self.clip_ratio_high = clip_high
        self.clip_ratio_c = clip_ratio_c
        self.policy_loss = {"loss_mode": loss_mode}
        self.tau_pos, self.tau_neg = taus  # SAPO's temperatures (verl's defaults 1.0 and 1.05)
        self.loss_agg_mode = loss_agg_mode
        self.loss_scale_factor = loss_scale_factor
        self.entropy_coeff = entropy_coeff
        self.use_kl_loss = kl is not None
        self.kl_loss_type, self.kl_loss_coef = kl if kl is not None else ("low_var_kl", 0.001)
        self.global_batch_info: dict[str, Any] = {}
