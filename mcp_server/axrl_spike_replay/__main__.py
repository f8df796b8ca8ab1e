"""`python -m axrl_spike_replay` runs the CLI (used on remote nodes)."""

from axrl_spike_replay.cli import main

raise SystemExit(main())
