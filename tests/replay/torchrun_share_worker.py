"""What a process torchrun starts runs for its share of a replay (tests/replay/test_sharded_replay.py): join the
group torchrun's environment describes, then `replay.jobs.job_runner.run_share`.

argv: the job file (a pickled WorkerJob the test itself wrote; never a file from elsewhere), the outcomes path."""

from __future__ import annotations

import pickle
import sys


def main() -> None:
    import torch.distributed as dist

    from axrl_spike_replay.replay.jobs.job_runner import run_share

    dist.init_process_group("gloo")  # rank, world size and the store from torchrun's environment
    try:
        with open(sys.argv[1], "rb") as handle:
            job = pickle.load(handle)  # written by the test that started this process
        run_share(job, sys.argv[2])
        dist.barrier()  # every process is done with the group before any tears it down (gloo aborts otherwise)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
