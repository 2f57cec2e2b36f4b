"""SIGUSR1 / SIGTERM: checkpoint at the next step boundary, then exit so SLURM can requeue.

The handler only raises a flag; the trainer all-reduces it across ranks at each step boundary
(every rank stops at the same step). A second signal during the save only sets the flag again,
so the save in progress completes (checkpoints are written to a temp name and renamed anyway).
"""
from __future__ import annotations

import signal

EXIT_REQUEUE = 3  # exit status after a signal-triggered checkpoint (slurm scripts requeue on it)


class StopFlag:
    def __init__(self):
        self.received: int | None = None

    def install(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> "StopFlag":
        for s in signals:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    @property
    def set(self) -> bool:
        return self.received is not None


def any_rank(flag: bool) -> bool:
    """True on every rank if the flag is set on any rank."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
