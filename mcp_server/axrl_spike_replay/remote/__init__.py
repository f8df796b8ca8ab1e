"""Remote GPU nodes over SSH: targets, host keys, sessions, node probe, command backend, patch worktrees."""
