"""``eval.interval``: lm-eval on ``eval.tasks`` every ``eval.interval`` steps, in a child process.

At each such step the checkpoint of that step is saved (forced when ``train.save_interval`` misses
it: :func:`due`) and, once it is published (at once for a synchronous save, at a later step's poll
for ``train.async_save``), rank 0 starts ``python -m megahash eval --checkpoint SAVE_DIR/step_N
--tasks ... --out SAVE_DIR/eval/step_N.json`` as a child process (its output in ``eval/step_N.log``).
The loop polls the children every step (``Popen.poll``, no collective) and logs each finished
evaluation's scores AT ITS STEP (split ``eval``, keys ``TASK/METRIC``) to metrics.jsonl, TensorBoard
and W&B (``RunLogger.log(..., late=True)``: W&B's own step only increases, so there the scores are
plotted against ``eval/step``). A failed child (non-zero exit) is one line on stdout, and training
goes on. At the end of a completed run the outstanding ones are waited for (``eval.wait_s``, then
killed; every rank waits with rank 0 through an all-reduce, :meth:`EvalDuring.finish`); after a stop
signal or an error they are killed.

Why a child process and not lm-eval inside the job (GPT-NeoX's ``eval_tasks``): the step loop does not
stall while lm-eval runs, the evaluation's model, lm-eval and datasets never share the training
process's memory, a crash or hang in it cannot take the run down, and it loads the checkpoint the
way ``megahash eval`` always does (its precision, a 1-rank group of its own, no launcher variables).

Pins: while step N is evaluated, ``SAVE_DIR/eval/step_N.pin`` exists (written when the step is due,
before its save can be pruned) and ``train.keep_last`` pruning (checkpoint.prune) skips a pinned
checkpoint; when the evaluation ends the pin goes and pruning runs again. Pins outside the step
folder: an asynchronous save's folder is ``step_N.tmp`` until it is published, and a pin inside it
would enter its manifest. A pin left by a killed job is removed at the next start (its evaluation
died with that job).

The child dies with the trainer: it starts in a session of its own (a stop signal to the trainer's
process group does not reach it; the trainer ends it itself) and sets Linux's PR_SET_PDEATHSIG
(async_save._die_with_parent) before anything else, so a trainer killed by SLURM (``scancel``, time
limit, node failure) or ``kill -9`` leaves no orphan evaluation holding the GPU.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megahash.checkpoint.layout import STATE_FILE, pin_path
from megahash.launching.env import LAUNCHER_VARS

FAIL_ENV = "MEGAHASH_TEST_EVAL_FAIL"  # tests: "STEP", the child of that step exits 1 at once (a planted failure)
WAIT_ENV = "MEGAHASH_TEST_EVAL_WAIT"  # tests: "STEP:FILE", the child of that step waits for FILE first


def due(cfg, step: int) -> bool:
    """Whether ``step`` is evaluated (every rank: the save it forces is collective)."""
    n = cfg.eval.interval
    return bool(n) and step % n == 0


def _tag(step: int) -> str:
    return f"step_{step:08d}"


class EvalDuring:
    """Rank 0's evaluations in flight: step -> child process (or None while its save is unpublished)."""

    def __init__(self, cfg, log, rank: int, consumed):
        self.cfg, self.log, self.consumed = cfg, log, consumed
        self.active = rank == 0 and bool(cfg.eval.interval)
        self.root = Path(cfg.train.save_dir)
        self.dir = self.root / "eval"
        self.running: dict[int, subprocess.Popen | None] = {}
        self.started: dict[int, float] = {}
        if rank == 0 and self.dir.is_dir():  # eval.interval off too: a stale pin would block pruning for good
            for stale in self.dir.glob("step_*.pin"):  # a killed job's: its evaluations died with it
                stale.unlink(missing_ok=True)

    def after_save(self, step: int) -> None:
        """Each step after the save: pin a due step, start what is published, log what finished."""
        if not self.active:
            return
        if due(self.cfg, step) and step not in self.running:
            self.dir.mkdir(parents=True, exist_ok=True)
            pin_path(self.root, _tag(step)).write_text(f"{os.getpid()}\n")
            self.running[step] = None
        self.poll()

    def poll(self) -> None:
        for step, proc in list(self.running.items()):
            if proc is None and (self.root / _tag(step) / STATE_FILE).is_file():
                self.running[step] = self._start(step)
            elif proc is not None and proc.poll() is not None:
                self._done(step, proc.returncode)

    def _start(self, step: int) -> subprocess.Popen:
        e = self.cfg.eval
        ckpt, out = self.root / _tag(step), self.dir / f"{_tag(step)}.json"
        argv = [
            sys.executable,
            "-m",
            "megahash.training.eval_during",
            str(os.getpid()),
            str(step),
            "eval",
            "--checkpoint",
            str(ckpt),
            "--out",
            str(out),
            "--overwrite",
            "--batch-size",
            str(e.batch_size),
        ]
        if e.tasks:
            argv += ["--tasks", ",".join(e.tasks)]
        if e.tasks_dir:
            argv += ["--tasks-dir", e.tasks_dir]
        if e.trust_task_code:
            argv.append("--trust-task-code")
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        root = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(self.dir / f"{_tag(step)}.log", "w") as logf:
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.started[step] = time.time()
        return proc

    def _done(self, step: int, status: int) -> None:
        """Log a finished evaluation at its step (or its failure in one line), unpin, prune again."""
        del self.running[step]
        out = self.dir / f"{_tag(step)}.json"
        scores = _scores(out) if status == 0 else None
        if scores is None:
            print(
                f"megahash: evaluation of step {step} failed ({_why(self.dir / f'{_tag(step)}.log', status)}); "
                f"training goes on",
                flush=True,
            )
        else:
            seconds = time.time() - self.started.pop(step, time.time())
            consumed = self.consumed(step)
            metrics = {
                **scores,
                "eval_s": seconds,
                "consumed_samples": consumed,
                "consumed_tokens": consumed * self.cfg.data.seq_length,
            }
            self.log.log(step, metrics, "eval", echo=False, late=True)
            shown = ", ".join(f"{k} {v:.4g}" for k, v in scores.items() if not k.endswith("_stderr"))
            print(f"[eval] step {step} {shown} ({seconds:.0f} s)", flush=True)
        self._unpin(step)

    def _unpin(self, step: int) -> None:
        from megahash.training.checkpoint import prune

        pin_path(self.root, _tag(step)).unlink(missing_ok=True)
        prune(self.root, self.cfg.train.keep_last)

    def finish(self, wait: bool) -> None:
        """Collective, at the end of the run: with ``wait``, every rank waits (one all-reduce per 0.2 s,
        so no rank's exit barrier times out) while rank 0 starts the published evaluations and polls
        them, at most ``eval.wait_s``; then rank 0 kills what is left (one line each)."""
        if not self.cfg.eval.interval:
            return
        from megahash.training.signals import any_rank

        deadline = time.time() + (self.cfg.eval.wait_s if wait else 0.0)
        if self.active and wait and self.running:
            print(
                f"megahash: waiting for {len(self.running)} evaluation(s) (at most {self.cfg.eval.wait_s:g} s)",
                flush=True,
            )
        while wait and any_rank(self.active and bool(self.running) and time.time() < deadline):
            self.poll()
            time.sleep(0.2 if self.running else 0.0)
        self.close()

    def close(self) -> None:
        """Kill every evaluation still running (after a stop or an error), unpinning its checkpoint;
        one that has just finished is logged."""
        for step, proc in list(self.running.items()):
            if proc is not None and proc.poll() is not None:
                self._done(step, proc.returncode)
                continue
            if proc is not None:
                proc.kill()
                proc.wait()
                print(f"megahash: evaluation of step {step} stopped unfinished (the run ended)", flush=True)
            del self.running[step]
            self._unpin(step)


def _scores(out: Path) -> dict | None:
    """``{"TASK/METRIC": value}`` of a ``megahash eval`` results file (None when unreadable)."""
    import json

    try:
        rec = json.loads(out.read_text())
    except (OSError, ValueError):
        return None
    return {
        f"{task}/{m}": v
        for task, row in (rec.get("results") or {}).items()
        for m, v in row.items()
        if isinstance(v, (int, float))
    }


def _why(log: Path, status: int) -> str:
    """The child's ``error: ...`` line (megahash's one-line errors), else its last line, else its status."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    err = next((line for line in reversed(lines) if line.startswith("error: ")), None)
    if status < 0:
        return f"killed by signal {-status}"
    text = err[len("error: ") :] if err else (lines[-1] if lines else "no output")
    return f"exit status {status}: {text[:300]}; log {log}"


def start(cfg, log, rank: int, consumed) -> EvalDuring:
    return EvalDuring(cfg, log, rank, consumed)


def _child(argv: list[str]) -> None:
    """The child: die with the trainer (PID ``argv[0]``), then ``megahash eval`` (``argv[2:]``)."""
    import runpy

    from megahash.training.async_save import _die_with_parent

    parent, step, rest = int(argv[0]), argv[1], argv[2:]
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if os.environ.get(FAIL_ENV) == step:
        print(f"error: planted failure of the evaluation of step {step} ({FAIL_ENV})", file=sys.stderr, flush=True)
        sys.exit(1)
    at, _, path = os.environ.get(WAIT_ENV, "").partition(":")
    deadline = time.time() + 120
    while at == step and not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.1)
    sys.argv = ["megahash", *rest]
    runpy.run_module("megahash", run_name="__main__", alter_sys=True)  # the command line, not imported here


if __name__ == "__main__":
    _child(sys.argv[1:])
