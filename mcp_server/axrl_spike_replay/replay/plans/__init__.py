"""A replay's plan before anything loads: its memory and what fits, the saved ranks each process replays, sharding."""
