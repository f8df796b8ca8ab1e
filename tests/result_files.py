"""A run's result files with what says when and where it ran left out, to compare two runs of the same work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# when and where it ran, not what it found (`shard_reason` quotes the memory the machine had free at that moment)
VOLATILE = {"timings", "created_at", "output_dir", "shard_reason"}


def stable(doc: Any) -> Any:
    """`doc` without its volatile keys, at any depth."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def result_files(output_dir: str | Path) -> dict[str, Any]:
    """Every JSON file under a run's output dir, by relative path, without its volatile keys."""
    root = Path(output_dir)
    return {str(p.relative_to(root)): stable(json.loads(p.read_text())) for p in sorted(root.rglob("*.json"))}
