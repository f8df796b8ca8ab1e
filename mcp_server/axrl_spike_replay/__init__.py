"""axrl-spike-replay: find, read, replay and mitigate gradient spikes in RL post-training of MoE LLMs."""

__version__ = "0.1.0"
