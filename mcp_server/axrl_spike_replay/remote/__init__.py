"""Remote GPU nodes: the transport (SSH targets, host keys, sessions, jobs), the launchers (local rank processes,
torchrun agents per node, Slurm allocations), the command backend, what a node has, and the engine on a node."""
