"""Read-only analyses of a spike step: attribution by sample and diagnose's model evidence, whole or sharded over
processes."""
