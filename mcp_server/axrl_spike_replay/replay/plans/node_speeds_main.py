"""An SSH node's side of the plan's speed measurement: its planner (`remote.nodes.remote_speeds`) runs

    python -m axrl_spike_replay.replay.plans.node_speeds_main SCRATCH SCRATCH_ERROR REQUEST

there, REQUEST a JSON document {"weights": the snapshot's weights dir (the same path there) or null, "device",
"dtype", "kept": the entries its planner keeps for this node}. It measures with `node_speeds.speeds_from`, the one
implementation this machine's plan also runs, reading the snapshot's copy where the node holds one, else a
temporary file in SCRATCH (a directory its caller made on the replay disk and removes; empty, with SCRATCH_ERROR
saying why, where none could be made). It prints one line: `MARK` and a JSON document {"host", "speeds",
"kept", "new"}; exit status 2 with the line's "error" for a request it cannot read.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from axrl_spike_replay.replay.plans.node_speeds import speeds_document, speeds_from

MARK = "@@axrl-speeds json "


def main(argv: list[str] | None = None) -> int:
    """Measure (or take as kept) this node's speeds for the request in `argv`; print the result line."""
    args = sys.argv[1:] if argv is None else argv
    try:
        scratch_dir, scratch_error, text = args
        request = json.loads(text)
        if not isinstance(request, dict):
            raise ValueError("the request is not a JSON object")
        weights, device, dtype = request.get("weights"), request.get("device"), request.get("dtype")
        if not (weights is None or isinstance(weights, str)) or device not in ("cpu", "cuda"):
            raise ValueError(f"weights {weights!r}, device {device!r}")
        if not isinstance(dtype, str):
            raise ValueError(f"dtype {dtype!r}")
    except ValueError as exc:  # json.JSONDecodeError and a wrong count of arguments included
        print(MARK + json.dumps({"error": f"unreadable request: {exc}"}), flush=True)
        return 2
    scratch: Path | str = Path(scratch_dir) if scratch_dir else f"no temporary directory could be made: {scratch_error}"
    kept = speeds_document(request.get("kept"))
    speeds, new = speeds_from(kept, socket.gethostname(), None if weights is None else Path(weights), device, dtype,
                              scratch)  # fmt: skip
    print(MARK + json.dumps({"host": socket.gethostname(), "speeds": speeds.to_json(), "kept": kept, "new": new}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
