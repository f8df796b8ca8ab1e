"""A replay-only experiment as engine, remote, record and diagnosis see it: mitigations, result, verdict, run dir."""
