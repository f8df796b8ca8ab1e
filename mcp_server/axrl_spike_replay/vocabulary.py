"""The tool's fixed vocabularies: verdicts, fidelity, what a request asks (verb, backend, device, attribution
method), spike-guard actions, and the cause families a diagnosis names.

Each is a `str` enum: a member *is* its string value, so JSON output, result files, task files,
templates and messages show exactly the strings they always did ("cleared", "full", "torch",
"skip"), while code and type checkers see one closed set. Torch-free, imported by every layer.
Written as `(str, Enum)` with `__str__`/`__format__`/`__repr__` giving the value rather than
`enum.StrEnum` (3.11+): the package also installs on GPU nodes whose Python is 3.10.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from axrl_spike_replay.display import shown
from axrl_spike_replay.errors import AxrlError

_V = TypeVar("_V", bound="Vocabulary")


class Vocabulary(str, Enum):
    """A closed set of strings; each member reads, prints and serialises as its value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    def __repr__(self) -> str:
        # Messages quote vocabulary values with !r ('cleared'); they keep doing so.
        return repr(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in declaration order."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls: type[_V], value: object, what: str) -> _V:
        """The member whose value is `value`; AxrlError naming `what` and the allowed values otherwise."""
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        raise AxrlError(f"{what} must be one of {', '.join(cls.values())}, got {shown(value, 60)}")


class Verdict(Vocabulary):
    """What a replay showed: baseline (reproduced / not_reproduced), mitigated (see experiment.verdict), failed."""

    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not_reproduced"
    CLEARED = "cleared"
    PARTIAL = "partial"
    NO_EFFECT = "no_effect"
    WORSE = "worse"
    BASELINE_NOT_A_SPIKE = "baseline_not_a_spike"
    FAILED = "failed"


class Fidelity(Vocabulary):
    """`full`: one replay process per saved rank; `reduced`: fewer (a diagnostic, summation order differs)."""

    FULL = "full"
    REDUCED = "reduced"


class Backend(Vocabulary):
    """Who recomputes the step: the built-in `torch` engine, Megatron-core's own GPTModel (`megatron`, route 2 of a
    Megatron snapshot: the `megatron` extra), or the trainer's own replay `command`."""

    TORCH = "torch"
    COMMAND = "command"
    MEGATRON = "megatron"


class Verb(Vocabulary):
    """What a replay request asks for: one replay, a sweep of configs, or an attribution to samples."""

    REPLAY = "replay"
    SWEEP = "sweep"
    ATTRIBUTE = "attribute"


class Device(Vocabulary):
    """Where the replay processes compute."""

    CPU = "cpu"
    CUDA = "cuda"


class Shard(Vocabulary):
    """Whether a replay shards the policy over its processes (FSDP2): when it does not fit one, always, never; or
    streams it, one decoder layer at a time in one process (`replay.streamed`)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"
    STREAMED = "streamed"


class Method(Vocabulary):
    """How an attribution gets each sample's gradient: one forward-mode pass, or one backward per sample (a check)."""

    JVP = "jvp"
    PER_SAMPLE_BACKWARD = "per_sample_backward"


class GuardAction(Vocabulary):
    """What the spike guard does on a step: `proceed` (no spike), or on a spike `log`, `skip` or `rollback`."""

    PROCEED = "proceed"
    LOG = "log"
    SKIP = "skip"
    ROLLBACK = "rollback"


WRITABLE_VERDICTS = (Verdict.CLEARED, Verdict.PARTIAL)  # a mitigation that did something to a real spike
GUARD_ACTIONS = (GuardAction.LOG, GuardAction.SKIP, GuardAction.ROLLBACK)  # what a tripped guard may do


# The cause families `diagnose` names, each for a broken part (diagnosis' package doc says what each means): shared
# by the diagnosis, the capture faults that plant them, the fault-matrix benchmark and the skill evals.
CAUSE_FAMILIES = (
    "engine_mismatch",
    "stale_old_logprobs",
    "bad_ref_logprobs",
    "routing_payload",
    "outlier_advantage",
    "mask_misalignment",
    "negative_advantage_dominance",
    "one_rank_data",
    "non_finite",
    "step_not_reproduced",
    "natural_spike",
)
