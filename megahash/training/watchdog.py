"""Hang watchdog: a step that runs past its limit dumps this rank's Python stacks and exits with the
requeue status, so SLURM requeues the job and it resumes from the last checkpoint (issue 35).

The limit of the optimizer step in flight is the smaller of ``train.watchdog.timeout_s`` and
``train.watchdog.factor`` x the median of this process's recent step times (after ``WARMUP_STEPS``
timed steps; the first step, with its compilation and warm-up, is not timed)::

    limit = min(timeout_s, factor * median(dt_2 .. dt_n))       (0 turns a rule off)

Validation and checkpoint saves after a step are held to ``train.watchdog.timeout_s`` alone (a save
legitimately takes many steps' time). A daemon thread per rank compares the clock with the limit;
when it is passed it writes every thread's stack (``faulthandler.dump_traceback(all_threads=True)``)
to ``<save_dir>/hang/rank<r>.txt`` and to stderr, prints one line and ends the process with
``os._exit(EXIT_REQUEUE)``: a collective that hangs cannot be unwound, so no ``finally`` runs.

The other ranks: those blocked in a collective with the hung rank time out on their own watchdog (their
step is as late); a collective that fails instead because the hung rank's process is gone (gloo:
connection closed) is turned into the same requeue exit by :meth:`HangWatchdog.requeue_after_peer_hang`
when a peer's report is in ``<save_dir>/hang/``; a rank that cannot run at all (stopped, or holding
the GIL) is ended by the launcher (``srun --wait``, torchrun's and DeepSpeed's launchers stop the
group when a rank exits). docs/long_runs.md compares this with torch's collective timeouts and
Megatron's straggler detector.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from megahash.config_checks import ranged
from megahash.errors import ConfigError
from megahash.training.hooks import Hook
from megahash.training.run_lock import release_held
from megahash.training.signals import EXIT_REQUEUE, report_exit


@dataclass
class Config:
    """``train.watchdog``: a step past its limit dumps the rank's stacks to save_dir/hang/ and exits 3 (requeue)."""

    timeout_s: float = ranged(0.0, "[0, inf)", "seconds a step may take before the watchdog fires; 0 = off")
    # a step longer than this x the median step time hangs (after 3 steps); 0 = off
    factor: float = ranged(0.0, "[0, inf)", "multiple of the median step time that counts as a hang; 0 = off")

    def check(self, cfg) -> None:
        if self.factor and self.factor <= 1:
            raise ConfigError(
                f"train.watchdog.factor={self.factor} must be > 1 (a multiple of the median step time) or 0 (off)"
            )
        if self.timeout_s and self.timeout_s >= cfg.train.distributed_timeout_s:
            raise ConfigError(
                f"train.watchdog.timeout_s={self.timeout_s:g} must be below train.distributed_timeout_s="
                f"{cfg.train.distributed_timeout_s} (a collective timing out first ends the rank as a failure, "
                f"not for requeue)"
            )


WARMUP_STEPS = 3  # timed steps before the factor applies (the first step of a process is never timed)
WINDOW = 100  # recent step times the median is taken over
POLL_S = 0.5  # how often the thread looks at the clock
PEER_WAIT_S = 5.0  # after a failed collective: how long to look for a peer's hang report (shared file system)


class HangWatchdog:
    """The watchdog of one rank (a no-op with both rules off). ``clock`` and ``exit`` are injectable
    for tests; :meth:`check` is what the thread runs every ``poll_s``."""

    def __init__(
        self,
        timeout_s: float,
        factor: float,
        rank: int,
        save_dir,
        clock=time.monotonic,
        exit=os._exit,
        poll_s: float = POLL_S,
    ):
        self.timeout_s, self.factor, self.rank = float(timeout_s), float(factor), rank
        self.dir = Path(save_dir) / "hang"
        self.clock, self.exit, self.poll_s = clock, exit, poll_s
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.started = time.time()  # wall clock: hang reports older than this process are another run's
        self._since: float | None = None  # clock when the watched span began; None: nothing watched
        self._step, self._in_step, self._untimed = 0, False, True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 or self.factor > 0

    def start(self) -> HangWatchdog:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="megahash-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def step_started(self, step: int) -> None:
        """Optimizer step ``step + 1`` begins (``step`` done so far)."""
        with self._lock:
            self._since, self._step, self._in_step = self.clock(), step + 1, True

    def step_ended(self) -> None:
        """The step is done: its time joins the median (not the first step's); the rest of the
        iteration (validation, save) is held to ``timeout_s`` alone."""
        with self._lock:
            now = self.clock()
            if self._since is not None and self._in_step and not self._untimed:
                self.times.append(now - self._since)
            self._untimed = False
            self._since, self._in_step = now, False

    def limit(self) -> tuple[float, str] | None:
        """(seconds, the rule in words) for the span now watched, or None (no limit)."""
        rules = []
        if self.timeout_s > 0:
            rules.append((self.timeout_s, f"train.watchdog.timeout_s={self.timeout_s:g}"))
        if self.factor > 0 and self._in_step and len(self.times) >= WARMUP_STEPS:
            med = statistics.median(self.times)
            rules.append((self.factor * med, f"train.watchdog.factor={self.factor:g} x median step {med:.3g} s"))
        return min(rules) if rules else None

    def check(self) -> bool:
        """Fire if the span watched now has run past its limit; True if it fired (``exit`` returned)."""
        with self._lock:
            if self._since is None:
                return False
            elapsed, limit = self.clock() - self._since, self.limit()
            step = self._step
        if limit is None or elapsed <= limit[0]:
            return False
        self.fire(step, elapsed, limit[1])
        return True

    def fire(self, step: int, elapsed: float, rule: str) -> None:
        """Every thread's stack to ``hang/rank<r>.txt`` and stderr, one line, then exit for requeue."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.txt"
        with open(path, "w") as f:
            f.write(
                f"rank {self.rank} hung at step {step} for {elapsed:.1f} s ({rule}), pid {os.getpid()}, "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        with contextlib.suppress(Exception):
            sys.stderr.write(path.read_text())
            sys.stderr.flush()
        print(
            f"megahash: rank {self.rank} hung at step {step} for {elapsed:.1f} s ({rule}); stacks in {path}; "
            f"exiting for requeue",
            flush=True,
        )
        report_exit(EXIT_REQUEUE)  # to megahash/launching/supervise.py, if it started this rank
        release_held()  # the lock of train.save_dir (rank 0): the hard exit runs no finally
        self.exit(EXIT_REQUEUE)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def peer_report(self) -> Path | None:
        """Another rank's hang report written since this process started, if any."""
        with contextlib.suppress(OSError):
            for p in sorted(self.dir.glob("rank*.txt")):
                if p.name != f"rank{self.rank}.txt" and p.stat().st_mtime >= self.started - 1:
                    return p
        return None

    @contextlib.contextmanager
    def requeue_after_peer_hang(self):
        """An error in the body (a collective that failed because a hung peer's watchdog ended its
        process) becomes the requeue exit when a peer's hang report appears within ``PEER_WAIT_S``."""
        try:
            yield
        except Exception:
            if not self.enabled:
                raise
            deadline = time.monotonic() + PEER_WAIT_S
            while (peer := self.peer_report()) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if peer is None:
                raise
            print(
                f"megahash: rank {self.rank}: a collective failed after a peer's watchdog fired ({peer}); "
                f"exiting for requeue",
                flush=True,
            )
            raise SystemExit(EXIT_REQUEUE) from None


def watchdog_for(t, rank: int) -> HangWatchdog:
    """The started watchdog of ``train`` config ``t`` on ``rank``."""
    return HangWatchdog(t.watchdog.timeout_s, t.watchdog.factor, rank, t.save_dir).start()


class _Hook(Hook):
    """The watchdog in the training loop: a step's span, then validation and the save's; its thread
    stopped before the end of the run waits for evaluations (no step of its)."""

    def __init__(self, watch: HangWatchdog):
        self.watch = watch

    def around_loop(self, run):
        return self.watch.requeue_after_peer_hang()  # a collective broken by a peer's hang watchdog: requeue

    def before_step(self, run) -> None:
        self.watch.step_started(run.step)

    def end_step(self, run) -> None:
        self.watch.step_ended()  # validation and saves: held to train.watchdog.timeout_s alone

    def close(self, run, status: int | None) -> None:
        self.watch.close()


def hook(run) -> _Hook:
    return _Hook(watchdog_for(run.cfg.train, run.rank))
