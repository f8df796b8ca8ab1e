"""Public test support: build small, valid spike snapshots for your own tests and benchmarks.

`testing.synthetic_snapshot.write_synthetic_snapshot(SyntheticSpec(...), output_dir)` writes a
snapshot in format v1 (random weights, batches with chosen outliers, routing payloads) without
training anything; our own tests and benchmarks use it. Nothing in the library imports it.
"""
