"""The spike guard inside a Megatron-core training loop: detect a grad-norm spike, snapshot the step, skip it.

    from axrl_spike_replay.integrations.megatron import MegatronSpikeGuard


    guard = MegatronSpikeGuard("checkpoints/spike_snapshots", model_section=..., loss_section=..., job_name="j")
    for iteration in range(start, end):
        guard.begin_step(model)                 # this step's forwards record their routes (Megatron's RouterReplay)
        loss = forward_backward(model, batch)   # one micro-batch per step
        model.finish_grad_sync()                # Megatron DDP: the data-parallel mean
        grad_norm = ...                         # global pre-clip norm, the same on every rank
        if guard.step(iteration, model, grad_norm, batch, loss=loss, num_tokens=tokens):  # this rank's loss
            optimizer.step()                    # False: a spike, snapshotted and skipped

A tripped guard writes the snapshot collectively, on every rank of every parallel group:
- weights through Megatron's own `dist_checkpointing.save(model.sharded_state_dict())` (torch_dist, in the
  training layout; any layout reads it back);
- each data-parallel rank's batch (written by the first rank of its model-parallel group);
- its routing payload as Megatron's router replay recorded it: the top-k ids of every MoE layer, int64
  [S*B, K], the pipeline stages' layers in order (`snapshot.trainer_formats.megatron_routes`); the snapshot's run config
  then replays them (`routing.replay: all`), so a replay takes the routes the step took;
- grad info: the global norm and every parameter's norm under its checkpoint key (`key[layer]`,
  `key[layer,expert]`), merged over the shards that hold it (the reduced gradient: the same on every rank); and
  the data-parallel rank's `loss` and `num_tokens` as `step` was given them (from the last pipeline stage, which
  computes the loss), so the replay's per-rank loss check compares them with the losses it recomputes;
- `run_config.yaml` (`model:` kind megatron as given, `loss:`, `routing:`, the parallel layout).

It never raises into training: any failure is logged once (with its traceback) and the step goes on as if the
guard were not there. A rank that cannot prepare its part enters the collective write saying so, and every rank
abandons it together (the snapshot writer's rank agreement). Needs torch, megatron-core and axrl_spike_replay.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MEGATRON_CORE_CHECKED = "0.16.1"
log = logging.getLogger("axrl_spike_replay.megatron_hook")


def unwrap(model: Any) -> Any:
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module) or a one-chunk model list."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"virtual pipeline chunks ({len(model)}) are not snapshotted; pass one model chunk")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def _routers(model: Any) -> dict[int, Any]:
    """{global layer id: TopKRouter} of the model's MoE layers on this pipeline stage."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = {}
    for module in unwrap(model).modules():
        if isinstance(module, TransformerLayer):
            router = getattr(getattr(module, "mlp", None), "router", None)
            if isinstance(router, TopKRouter):
                found[int(module.layer_number) - 1] = router
    return found


def _grad(param: Any) -> Any:
    grad = getattr(param, "main_grad", None)  # Megatron DDP accumulates into main_grad
    return grad if grad is not None else param.grad


def _zero_replica(replica_id: Any) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(int(i) == 0 for i in ids)


def parameter_norms(model: Any) -> dict[str, float]:
    """{checkpoint key[layer(,expert)]: grad norm} over the whole model: each shard counted once (the main
    replica, as Megatron saves it), merged over every rank. Collective.

    Exact when every replica of a shard holds the same gradient, as after Megatron's `finalize_model_grads` (the
    data-parallel reduction, and at TP>1 the all-reduce of the layer-norm and router gradients that sequence
    parallelism leaves partial on each tensor-parallel rank). Replicas that disagree are logged once (up to three
    names): the merge then holds the main replica's partial gradient, not the step's."""
    import math

    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sums: dict[str, float] = {}
    replicas: dict[str, dict[str, float]] = {}  # shard (name and offset) -> {replica id: its sum of squares}

    def add(shard: Any, grad: Any) -> None:
        if not isinstance(shard, ShardedTensor) or grad is None:
            return
        index = ",".join(str(int(o)) for o in shard.global_offset[: shard.prepend_axis_num])
        name = f"{shard.key}[{index}]" if index else shard.key
        square = float(grad.detach().double().pow(2).sum())
        ids = shard.replica_id if isinstance(shard.replica_id, tuple) else (shard.replica_id,)
        piece = replicas.setdefault(f"{name}@{tuple(int(o) for o in shard.global_offset)}", {})
        replica = ",".join(str(int(i)) for i in ids)
        piece[replica] = piece.get(replica, 0.0) + square
        if _zero_replica(shard.replica_id):
            sums[name] = sums.get(name, 0.0) + square

    for item in unwrap(model).sharded_state_dict().values():
        param = getattr(item, "data", None)
        if not isinstance(param, torch.nn.Parameter):
            continue
        grad = _grad(param)
        if isinstance(item, ShardedTensorFactory) and grad is not None:
            built = item.build_fn(item.key, grad.view_as(param), item.replica_id, item.flattened_range)
            for shard in nested_values(built if isinstance(built, (dict, list)) else [built]):
                add(shard, shard.data)
        else:
            add(item, grad)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sums, replicas))
    merged: dict[str, float] = {}
    every: dict[str, dict[str, float]] = {}
    for part, pieces in gathered:
        for name, value in part.items():
            merged[name] = merged.get(name, 0.0) + value
        for piece, values in pieces.items():
            every.setdefault(piece, {}).update(values)
    differ = sorted(
        piece.split("@")[0]
        for piece, values in every.items()
        if len(values) > 1 and max(values.values()) - min(values.values()) > 1e-9 * max(values.values())
    )
    if differ and dist.get_rank() == 0:
        log.warning(
            "axrl spike guard: the gradient of %s differs between its replicas (%d shard(s) in all): gradients are "
            "not reduced over every replica yet (at TP>1 call megatron's finalize_model_grads before the guard, "
            "as its training loop does); the recorded per-parameter norms are the main replica's",
            ", ".join(sorted(set(differ))[:3]),
            len(differ),
        )
    return {name: math.sqrt(value) for name, value in sorted(merged.items())}


def _scalar(value: Any) -> float | None:
    """A loss or token count as a float (a tensor detached), None when not given."""
    if value is None:
        return None
    return float(value.detach().float().sum()) if hasattr(value, "detach") else float(value)


def _last_stage_loss(loss: float | None, num_tokens: float | None) -> tuple[float | None, float | None]:
    """The loss and token count the last pipeline stage was given, on every stage of this pipeline. Collective over
    the pipeline group (nothing to gather without pipeline parallelism)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return loss, num_tokens
    group: Any = ps.get_pipeline_model_parallel_group()  # one group (no virtual pipeline lists here)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (loss, num_tokens), group=group)
    return parts[-1]


def parallel_layout() -> Any:
    """This job's layout from Megatron's parallel_state (the snapshot's `parallel`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from axrl_spike_replay.snapshot.metadata import ParallelLayout

    return ParallelLayout(
        world_size=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size() or 1,
        cp=ps.get_context_parallel_world_size(),
    )


class MegatronSpikeGuard:
    """The spike guard for a Megatron-core loop (see the module docstring). Every method is safe to call from
    training: it logs its first failure and never raises."""

    def __init__(
        self,
        snapshots_root: str | Path,
        *,
        model_section: Mapping[str, Any],
        loss_section: Mapping[str, Any],
        job_name: str = "megatron-job",
        detector: Any = None,
        action: str = "skip",
        keep_last: int | None = 3,
        train_section: Mapping[str, Any] | None = None,
    ) -> None:
        self.snapshots_root = Path(snapshots_root)
        self.model_section = dict(model_section)
        self.loss_section = dict(loss_section)
        self.train_section = dict(train_section or {})
        self.job_name = job_name
        self._detector = detector
        self._action = action
        self._keep_last = keep_last
        self._guard: Any = None
        self._failed: set[str] = set()
        self._hooked: set[int] = set()
        self._routes: dict[int, Any] = {}  # global layer -> the step's last recorded top-k ids [S*B, K]
        self.snapshots: list[Path] = []

    def _fail(self, where: str) -> None:
        if where not in self._failed:
            self._failed.add(where)
            log.exception("axrl spike guard: %s failed; training goes on without it", where)

    @property
    def guard(self) -> Any:
        """The SpikeGuard deciding on each step (built on first use)."""
        if self._guard is None:
            from axrl_spike_replay.capture.guard_settings import guard_detector
            from axrl_spike_replay.capture.spike_guard import SpikeGuard

            self._guard = SpikeGuard(
                self.snapshots_root,
                action="skip" if self._action == "rollback" else self._action,  # Megatron owns its checkpoints
                detector=self._detector or guard_detector(),  # the hooks' shared default: armed from step 1
                keep_last=self._keep_last,
                job_name=self.job_name,
            )
        return self._guard

    def begin_step(self, model: Any) -> None:
        """Before the step's forward: every router records its top-k ids (Megatron's RouterReplay RECORD, unless
        the trainer replays routes already: then the replayed ones are kept)."""
        try:
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            self._routes = {}
            for layer, router in _routers(model).items():
                replay = router.router_replay
                if replay is None:
                    raise ValueError("the model is built without moe_enable_routing_replay: no routes to record")
                if replay.router_replay_action is None:
                    replay.set_router_replay_action(RouterReplayAction.RECORD)
                if id(router) not in self._hooked:
                    router.register_forward_hook(self._recorder(layer))
                    self._hooked.add(id(router))
        except Exception:
            self._fail("begin_step")

    def _recorder(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            replay = module.router_replay
            ids = replay.recorded_topk_idx if replay.recorded_topk_idx is not None else replay.target_topk_idx
            if ids is not None:
                self._routes[layer] = ids.detach()

        return hook

    def step(
        self,
        iteration: int,
        model: Any,
        grad_norm: Any,
        batch: Mapping[str, Any],
        *,
        loss: Any = None,
        num_tokens: Any = None,
    ) -> bool:
        """Judge the step's global pre-clip grad norm; on a spike snapshot it (collective). True: take the
        optimizer step. A failure anywhere logs once and answers True.

        `loss`: the loss this data-parallel rank backpropagated (a float or a scalar tensor: the sum over its
        micro-batches as the gradient saw it), and `num_tokens` the loss tokens it counted; recorded in grad info
        (`loss`, `num_tokens`) for the replay's per-rank loss check. Only the last pipeline stage has them: other
        stages pass None. Without them the snapshot records no loss and that check is skipped."""
        try:
            decision = self.guard.observe(iteration, float(grad_norm))
        except Exception:
            self._fail("step")
            return True
        if decision.tripped:
            try:
                self._snapshot(decision, model, batch, _scalar(loss), _scalar(num_tokens))
            except Exception:
                self._fail("snapshot")
        return bool(decision.apply_update)

    def _snapshot(
        self, decision: Any, model: Any, batch: Mapping[str, Any], loss: float | None, num_tokens: float | None
    ) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core import parallel_state as ps

        from axrl_spike_replay.capture.snapshot_writer import RankPayload

        layout = self.guard.parallel
        ranks: dict[int, Any] = {}
        problem = None
        try:
            layout = parallel_layout()
            routes = self._gather_routes(model, batch)
            norms = parameter_norms(model)
            loss, num_tokens = _last_stage_loss(loss, num_tokens)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0:
                grad_info = {
                    "grad_norm": float(decision.grad_norm),
                    "param_grad_norms": norms,
                    "param_grad_norms_kind": "reduced",
                    "loss": loss,
                    "num_tokens": num_tokens,
                }
                cpu_batch = {k: v.detach().cpu() for k, v in batch.items() if hasattr(v, "detach")}
                ranks[ps.get_data_parallel_rank()] = RankPayload(cpu_batch, grad_info, routes)
        except Exception as exc:
            self._fail("preparing the snapshot")
            problem = f"preparing the Megatron snapshot: {type(exc).__name__}: {exc}"
        self.guard.parallel = layout
        gpt: Any = unwrap(model) if problem is None else None

        def write_weights(directory: Path) -> None:  # called only when every rank prepared its part
            dist_checkpointing.save(gpt.sharded_state_dict(), str(directory))

        # Collective: a rank that could not prepare its part says so (`local_error`) and every rank abandons the
        # write together (the writer's rank agreement); the guard logs a failed write and returns None.
        path = self.guard.snapshot(
            decision, {}, ranks, run_config=self._run_config(layout), local_error=problem, weights_writer=write_weights
        )
        if path is not None:
            self.snapshots.append(path)

    def _gather_routes(self, model: Any, batch: Mapping[str, Any]) -> dict[str, Any] | None:
        """The data-parallel rank's routing payload (Megatron's form), every stage's layers, on the first rank of
        its model-parallel group; None elsewhere or when no router recorded."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from axrl_spike_replay.snapshot.trainer_formats.megatron_routes import megatron_payload

        local = {layer: ids.cpu() for layer, ids in self._routes.items()}
        group: Any = ps.get_model_parallel_group()
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (ps.get_tensor_model_parallel_rank(), local), group=group)
        sequence_parallel = bool(getattr(unwrap(model).config, "sequence_parallel", False))
        layers: dict[int, list[tuple[int, Any]]] = {}
        for tp_rank, recorded in parts:
            for layer, ids in recorded.items():
                layers.setdefault(layer, []).append((tp_rank, ids))
        if not layers:
            return None
        tokens = batch["tokens"] if "tokens" in batch else batch["input_ids"]
        micro, seq = int(tokens.shape[0]), int(tokens.shape[1])
        merged = []
        for layer in sorted(layers):
            pieces = sorted(layers[layer], key=lambda item: item[0])
            if sequence_parallel:  # each TP rank routed its slice of the sequence
                merged.append(torch.cat([ids for _, ids in pieces]))
            else:
                merged.append(pieces[0][1])
        return megatron_payload(merged, sorted(layers), micro, seq)

    def _run_config(self, layout: Any) -> dict[str, Any]:
        from dataclasses import asdict

        from axrl_spike_replay.models.mcore.megatron_cpu import megatron_core_version

        return {
            "model": dict(self.model_section),
            "loss": dict(self.loss_section),
            "routing": {"replay": "all", "current_routing_layers": []},
            "parallel": asdict(layout),
            "train": {
                "trainer": "megatron-core",
                "megatron_version": megatron_core_version() or "unknown",
                **self.train_section,
            },
        }
