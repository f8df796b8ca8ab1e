"""Running a replay job: its rank processes, the job as JSON for torchrun, the torchrun worker, the warm pool."""
