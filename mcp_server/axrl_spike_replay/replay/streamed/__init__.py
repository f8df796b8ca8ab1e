"""A replay one decoder layer at a time, reading each layer from the checkpoint: full fidelity on one device."""
