#!/usr/bin/env python3
"""Regenerate the mitigation catalogue (skill reference) and docs/mitigations.md from the declarations.

Usage: scripts/render_mitigation_catalogue.py [--check]
`--check` writes nothing and exits 1 when a file is out of date. The declarations are
`axrl_spike_replay.experiment.mitigation.mitigations.MITIGATIONS`; the blocks sit between
`<!-- mitigation-*:begin/end -->`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axrl_spike_replay.experiment.mitigation.mitigation_catalogue import rendered_files
from axrl_spike_replay.files.atomic import atomic_write_text

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Render (or check) the generated blocks; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date; write nothing")
    parser.add_argument("--repo", type=Path, default=REPO, help="checkout holding docs/ and skills/")
    args = parser.parse_args(argv)
    stale = 0
    for path, wanted in rendered_files(args.repo).items():
        if path.read_text(encoding="utf-8") == wanted:
            print(f"{path}: mitigations up to date")
        elif args.check:
            print(f"{path}: mitigations out of date; run scripts/render_mitigation_catalogue.py", file=sys.stderr)
            stale = 1
        else:
            atomic_write_text(path, wanted)
            print(f"{path}: mitigations updated")
    return stale


if __name__ == "__main__":
    raise SystemExit(main())
