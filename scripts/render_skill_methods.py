#!/usr/bin/env python3
"""Regenerate the recorded-methods list of skills/axrl-spike-replay/SKILL.md from spike-mitigation-methods/.

Usage: scripts/render_skill_methods.py [--check] [--methods-root DIR] [--skill FILE]
`--check` writes nothing and exits 1 when the skill's list is out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from axrl_spike_replay.files.atomic import atomic_write_text
from axrl_spike_replay.skill_pack import methods_block, with_methods_block
from axrl_spike_replay.workspace.method_files.methods import list_methods

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Render (or check) the list; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the list is out of date; write nothing")
    parser.add_argument("--methods-root", type=Path, default=REPO, help="workspace holding spike-mitigation-methods/")
    parser.add_argument("--skill", type=Path, default=REPO / "skills" / "axrl-spike-replay" / "SKILL.md")
    args = parser.parse_args(argv)
    current = args.skill.read_text(encoding="utf-8")
    wanted = with_methods_block(current, methods_block(list_methods(args.methods_root)))
    if wanted == current:
        print(f"{args.skill}: recorded methods up to date")
        return 0
    if args.check:
        print(f"{args.skill}: recorded methods out of date; run scripts/render_skill_methods.py", file=sys.stderr)
        return 1
    atomic_write_text(args.skill, wanted)
    print(f"{args.skill}: recorded methods updated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
