"""The causes: each family's rule read from the evidence, scoped to the ranks the per-rank figures single out,
ties broken."""
