"""The fault matrix's held-out sets (`testing.fault_matrix`), one module per set, each written before the rules
that read it."""
