"""Launchers: the replay's processes started here, by torchrun agents over SSH, or by Slurm; one protocol."""
