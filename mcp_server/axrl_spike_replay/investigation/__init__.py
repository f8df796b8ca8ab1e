"""Orchestration: run a replay request here or on a node and record it in the investigation's task."""
