"""What a replay reads from a snapshot, validated first: its inputs and every rank's inputs held to the model."""
