"""Causes ranked from evidence: every stored signal against the replay, per rank; the loss term that carries the
spike; the job's log scan; the experiments that would refute each cause.

The contract (what benchmarks, evals and the record code against; stable across releases):

`diagnose.diagnose_snapshot(snapshot, *, attribution=None, logs=None, model="auto", top=10) -> Diagnosis`.
`model` is the size rule for the evidence that needs a forward at the snapshot's weights: `auto` computes it on
the CPU when the checkpoint is at most `model_evidence.AUTO_MODEL_BYTES`, `always` whatever the size, `never`
not at all (what was left out is listed in `Diagnosis.not_checked`).

`Diagnosis.causes` is ranked, strongest first, and never empty. Each `causes.Cause` carries:

- `family`: one stable id of `families.FAMILIES` (listed below);
- `title`: the broken part in words (`"rank 1's old log-probs"`);
- `strength` in [0, 1]: 1.0 only with evidence that separates this family from every other (a witness pair that
  agrees where the named signal disagrees); two families that fit equally are both reduced and name each other in
  `tied_with`; `causes.LIKELY` (0.3) is the least reported as likely;
- `ranks`: the saved DP ranks it names (empty: spread over the ranks, or no rank evidence);
- `samples`: the `(rank, sample)` pairs it names (empty: none singled out);
- `term`: the loss term that carries the gradient when known (`policy`, `kl`, `entropy`, `aux`, `z`), else None;
- `evidence`: sentences with numbers; `figures`: the same numbers by name;
- `experiments`: ready `--mitigation NAME=VALUE` items (`causes.Experiment`: `mitigation`, `why`,
  `diagnostic_only`, `refutes`: the outcome that would refute the cause), least invasive first, never a no-op
  for the snapshot's own config;
- `tied_with`: the families that fit the evidence as well as this one.

`Diagnosis.step` (`experiment.step_evidence.StepEvidence`, None without the model): `step.signals`, per rank, the
replayed current log-probs (under the run's routing, and under the model's own when it replays routes) against
the stored old, rollout and reference log-probs, old against rollout, per sample; and the recorded routes against
the model's own routing per MoE layer, loss and non-loss tokens. `step.channel` (`LossChannel`): the spike's
gradient split by loss term, per rank, with the tokens each term pulls hardest. `Diagnosis.reading`
(`signal_reading.SignalReading`): the odd stored signal found (`reading.odd`: which signal, on which ranks, with
its witnesses). `no_ops.no_op_reason(item, loss, routing)` says why an item would change nothing in a run.

FAMILIES, with the broken part each names:

- `engine_mismatch`: the rollout engine's log-probs disagree with the trainer on every rank (an engine/trainer
  mismatch spread over the ranks);
- `stale_old_logprobs`: the stored old log-probs disagree with the policy at the snapshot's weights while the
  rollout (or reference) log-probs agree with it, on some ranks (stale or misaligned old log-probs);
- `bad_ref_logprobs`: the stored reference log-probs are wrong or misaligned on some ranks (the KL term carries
  the spike); the reference is another model, so a distance to it alike on every rank is the policy's drift and
  singles out no rank, and a reference whose ranks' KL term carries almost none of the gradient is not the cause;
  where no rank's stored values stand out, a KL term that pulls far harder on one rank than on any other (its
  gradient and its value), whichever way that rank's distance differs, singles its reference out;
- `routing_payload`: the recorded routes of some ranks disagree with the model's own routing while the other
  ranks' agree (a corrupt or misaligned routing payload);
- `outlier_advantage`: a few samples' advantages are far beyond the rest (incl. a reward-scale bug), or one rank's
  advantages are on another scale than the others' while its data is alike (`rank_inputs`), or are not what the
  run's recorded estimator makes of that rank's own rewards (`advantage_consistency`: groups off centre, or out of
  the rewards' order);
- `mask_misalignment`: loss masks that are truncated or shifted against the tokens they belong to, or that start
  before every other rank's on some ranks (`rank_inputs`);
- `negative_advantage_dominance`: negative advantages outweigh positive ones over the loss tokens;
- `one_rank_data`: one rank's batch carries the spike with no stored signal singled out there, and what it was
  fed differs from the other ranks' (its typical sample far less likely to the policy, or its advantages a few
  times the others'); data alike the others' is a few hard samples that landed on that rank (`natural_spike`);
- `non_finite`: non-finite values in the batch or the gradient;
- `step_not_reproduced`: the replay does not give the recorded step; each rank's recorded loss and per-parameter
  norms against the replay's say which ranks differ and how (one factor: a loss or gradient scale outside the
  recorded config; a factor per layer or parameter family; no pattern: a stored batch that is not the one trained
  on), and the recorded norm is predicted from them (`reproduction`); first whenever the step does not reproduce;
- `natural_spike`: no broken part found: the batch is simply hard (the fallback, weak unless the model evidence
  was checked and every stored signal agrees).
"""

from axrl_spike_replay.diagnosis.families import FAMILIES, LOSS_TERMS

__all__ = ["FAMILIES", "LOSS_TERMS"]
