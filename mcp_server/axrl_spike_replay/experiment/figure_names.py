"""Figure names that say what they compare, and the names files written before them still carry.

A log-ratio figure names its two sides, `<figure>_<a>_vs_<b>`, as `diagnose`'s evidence does
(`max_abs_log_ratio_current_vs_rollout`, `fraction_outside_0.5_2_old_vs_rollout`):

- `current`: the replayed policy at the snapshot's weights;
- `old`, `rollout`, `ref`: the stored log-probs of that name;
- `base`: the log-probs the run's PPO ratio is taken against (`old` or `rollout`), named beside the figure
  (`log_ratio_base`).

Where each is written (old name in brackets):

- `attribute`'s samples: `max_abs_log_ratio_current_vs_base` (`max_abs_log_ratio`);
- `diagnose`'s `attribution_top`: the same (`max_abs_log_ratio_vs_base`), with `log_ratio_base`;
- `analyze`'s sample rows and outliers: `max_abs_log_ratio_old_vs_rollout`, `seq_log_ratio_old_vs_rollout`,
  `log_ratio_old_vs_rollout`, `ratio_old_vs_rollout`, `tokens_by_abs_log_ratio_old_vs_rollout`,
  `samples_by_abs_log_ratio_old_vs_rollout`, the section `ratio_old_vs_rollout` (each was its name without the
  suffix; code still reads the section as `BatchAnalysis.ratio`);
- a replay's `rank_metrics`: `max_abs_log_ratio_current_vs_old` or `_current_vs_rollout` (`max_abs_log_ratio`),
  `kl_current_vs_ref` (`kl`).

Of the stored documents, `attribution.json` is read back (by `diagnose`, the report, `method add`): its readers take
the old name through `with_current_names`. Nothing reads a stored diagnosis' top samples, an analysis or a rank's
metrics back by these names.
"""

from __future__ import annotations

from typing import Any

# old name -> current name, per kind of row a stored file holds and something reads back
ATTRIBUTION_SAMPLE = {"max_abs_log_ratio": "max_abs_log_ratio_current_vs_base"}  # attribution.json samples[]


def with_current_names(row: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    """`row` with every old name of `renamed` read under its current name (a current name already there wins)."""
    return {renamed.get(k, k): v for k, v in row.items() if k not in renamed or renamed[k] not in row}
