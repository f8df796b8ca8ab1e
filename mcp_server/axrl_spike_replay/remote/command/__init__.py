"""The command backend: a trainer's own replay command on a node, its overrides, result and patched worktree."""
