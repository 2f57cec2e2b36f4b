"""SIGUSR1 / SIGTERM: checkpoint at the next step boundary, then exit so SLURM can requeue.

The handler only raises a flag; the trainer all-reduces it across ranks at each step boundary
(every rank stops at the same step). A second signal during the save only sets the flag again,
so the save in progress completes (checkpoints are written to a temp name and renamed anyway).
Saves run inside ``StopFlag.deferred()``: helper processes a save starts (megatron
dist-checkpointing spawns a multiprocessing manager) inherit the signals blocked, so a signal sent
to the whole process tree, as SLURM does for a job step, cannot kill them mid-save.
"""
from __future__ import annotations

import contextlib
import signal

EXIT_REQUEUE = 3  # exit status after a signal-triggered checkpoint (slurm scripts requeue on it)


class StopFlag:
    def __init__(self):
        self.received: int | None = None

    def install(self, signals=(signal.SIGUSR1, signal.SIGTERM)) -> "StopFlag":
        for s in signals:
            signal.signal(s, self._handle)
        self.signals = tuple(signals)
        return self

    @contextlib.contextmanager
    def deferred(self):
        """Block the installed signals in this thread while the body runs (a checkpoint save).
        Processes started meanwhile inherit the block (a spawned Python has no handler and would
        die of the default action); a signal arriving meanwhile still sets the flag (another thread
        takes it, or it is delivered when the block ends), so none is lost."""
        sigs = getattr(self, "signals", ())
        with immune_children(sigs):
            yield

    def _handle(self, signum, frame):
        self.received = signum

    @property
    def set(self) -> bool:
        return self.received is not None


@contextlib.contextmanager
def immune_children(sigs=(signal.SIGUSR1, signal.SIGTERM)):
    """Block ``sigs`` in this thread while the body runs: processes it starts (megatron's
    multiprocessing manager, DataLoader workers) inherit the block and survive a signal sent to the
    whole process group or tree; this process still receives it when the block ends.

    The multiprocessing resource tracker is started inside the block first: Python starts it on the
    first spawn and then *unblocks* SIGINT/SIGTERM in the calling thread (``ensure_running``), which
    let a manager spawned by the first checkpoint save take the SIGTERM meant for the trainer
    (``BrokenPipeError`` in the next save)."""
    if not sigs:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        try:
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
        except Exception:  # noqa: BLE001 - no tracker on this platform: nothing to protect
            pass
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # ensure_running may have unblocked SIGTERM
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def any_rank(flag: bool) -> bool:
    """True on every rank if the flag is set on any rank."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    from megahash import accelerator

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=accelerator.device())  # nccl: on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
