"""SIGUSR1 / SIGTERM / SIGINT: checkpoint at the next step boundary, then exit so SLURM can requeue.

The handler only raises a flag; the trainer all-reduces it across ranks at each step boundary
(every rank stops at the same step). A second signal during the save only sets the flag again,
so the save in progress completes (checkpoints are written to a temp name and renamed anyway).
Saves run inside ``StopFlag.deferred()``: helper processes a save starts (megatron
dist-checkpointing spawns a multiprocessing manager) inherit the signals blocked, so a signal sent
to the whole process tree, as SLURM does for a job step, cannot kill them mid-save.

Start-up: ``install_early`` is the first thing a rank does (megahash/pretrain.py, before torch,
DeepSpeed and megatron are imported and the engine is built). A stop signal that arrives while the
rank is still starting is remembered and honoured at the first step boundary (``StopFlag.install``
adopts it), so a SLURM time-limit signal that comes early cannot kill a half-initialised rank
(which requeued a job that never progressed), and every run makes at least one step.

Supervision: under ``megahash/launching/supervise.py`` (``python -m launch`` for deepspeed and torchrun) each
rank registers itself in ``$MEGAHASH_RANK_STATUS_DIR`` when its early handler is in place and
writes its exit status there at the end; the supervisor forwards stop signals to registered ranks
only and exits with the requeue status when they stopped on a signal.
"""

from __future__ import annotations

import contextlib
import os
import signal

from megahash.atomic_write import write_text_atomic

EXIT_REQUEUE = 3  # exit status after a signal-triggered checkpoint (slurm scripts requeue on it)
# SIGINT: Ctrl-C, which torchrun's agent also forwards to the ranks as it is (deepspeed's launcher sends SIGTERM);
# a KeyboardInterrupt traceback on every rank and the steps since the last checkpoint lost before
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
STATUS_DIR_ENV = "MEGAHASH_RANK_STATUS_DIR"  # set by megahash/launching/supervise.py: ranks register and report there

_pending: int | None = None  # a stop signal received before the trainer's StopFlag exists


def _remember(signum, frame):
    global _pending
    _pending = signum


def install_early(signals=STOP_SIGNALS) -> dict:
    """Catch the stop signals from the first line of a rank on (before the slow imports and the
    engine build): one that arrives now is kept and honoured at the first step boundary, instead of
    killing the rank half-initialised. Then register with a supervising launcher, if any. Returns
    the previous handlers (for ``restore``)."""
    previous = {s: signal.signal(s, _remember) for s in signals}
    _write_status("")
    return previous


def restore(previous: dict) -> None:
    """The handlers from before ``install_early`` again (the entry point called in-process, e.g. by
    tests), except after a stop on a signal: those stay ignored until the process exits."""
    global _pending
    _pending = None
    for s, handler in previous.items():
        if signal.getsignal(s) is not signal.SIG_IGN and handler is not None:
            signal.signal(s, handler)


def ignore_stops(signals=STOP_SIGNALS) -> None:
    """A process that ends now: further stop signals are ignored (its work is done or saved)."""
    global _pending
    _pending = None
    for s in signals:
        signal.signal(s, signal.SIG_IGN)


def release_early(signals=STOP_SIGNALS) -> None:
    """``train.exit_signal_handler=false``: the default actions again (a signal kept meanwhile now
    takes its default action)."""
    global _pending
    for s in signals:
        signal.signal(s, signal.SIG_DFL)
    if _pending is not None:
        sig, _pending = _pending, None
        signal.raise_signal(sig)


def report_exit(status: int) -> None:
    """Tell a supervising launcher (megahash/launching/supervise.py) this rank's exit status: deepspeed and
    torchrun report their own, not the ranks' requeue status 3."""
    _write_status(str(int(status)))


def _write_status(text: str) -> None:
    d = os.environ.get(STATUS_DIR_ENV)
    if not d or not os.path.isdir(d):
        return
    path = os.path.join(d, f"rank-{os.getpid()}")
    try:
        write_text_atomic(path, text)
    except OSError:  # the supervisor's folder is gone: nobody to tell
        pass


class StopFlag:
    def __init__(self):
        self.received: int | None = None

    def install(self, signals=STOP_SIGNALS) -> StopFlag:
        global _pending
        for s in signals:
            signal.signal(s, self._handle)
        self.signals = tuple(signals)
        if _pending is not None and self.received is None:  # arrived during start-up (install_early)
            self.received = _pending
        _pending = None
        return self

    def stop_listening(self) -> None:
        """After the stop checkpoint: ignore further stop signals. Late copies (SLURM signals every
        process again, a launcher terminates the ranks it supervises) must not kill the rank while
        it exits: Python restores the default action of handled signals at finalisation."""
        for s in getattr(self, "signals", ()):
            signal.signal(s, signal.SIG_IGN)

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
def immune_children(sigs=STOP_SIGNALS):
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
        except Exception:  # no tracker on this platform: nothing to protect
            pass
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # ensure_running may have unblocked SIGTERM
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def any_rank(flag: bool) -> bool:
    """True on every rank if the flag is set on any rank."""
    return any_ranks(flag)[0]


def any_ranks(*flags: bool) -> tuple[bool, ...]:
    """Each flag True on every rank if it is set on any rank (one all-reduce for all of them)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(bool(f) for f in flags)
    from megahash.accelerator import policy

    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=policy.device())  # nccl: on the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())
