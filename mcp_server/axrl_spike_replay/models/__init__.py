"""The policies a replay builds from a snapshot's `run_config.yaml`: the tiny MoE, and each declared architecture."""
