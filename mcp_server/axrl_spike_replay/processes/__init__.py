"""Rank processes: where they come from, running a function in one process per rank, the worker's half of the
launch contract."""
