"""Reference models the project can build from a snapshot's `run_config.yaml`."""
