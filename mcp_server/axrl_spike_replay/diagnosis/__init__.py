"""Causes ranked from evidence: the stored signals against the replay, per rank; the job's log scan; experiments."""
