"""Replay: recompute a spike step's gradients, with replay-only mitigations."""
