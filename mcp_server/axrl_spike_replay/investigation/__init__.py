"""Orchestration: run a replay request here or on a node, record it through one recorder, open a task with its
diagnosis."""
