"""Profiling chosen steps of the real run (``train.profile_steps: [START, END]``; empty = off), as
torchtitan's ``maybe_enable_profiling`` / ``maybe_enable_memory_snapshot`` and Megatron's
``--profile --profile-step-start --profile-step-end`` do.

For the steps START..END (1-based, inclusive) every rank runs under ``torch.profiler`` (the CPU's
operators; on a CUDA device its kernels too: ``accelerator.measurement.profiler_activities``) and writes a
Chrome-trace JSON that Perfetto, ``chrome://tracing`` and TensorBoard's profile plugin read::

    SAVE_DIR/profile/steps_START-END/rank{R}.pt.trace.json

A traced step is the range ``ProfilerStep#N`` (torch.profiler's name of a step, by which TensorBoard's
profile plugin splits a trace; N is the run's step) holding, per micro-batch, the
ranges ``megahash/data``, ``megahash/forward``, ``megahash/backward``, ``megahash/optimizer``
(:func:`phase`; :data:`PHASES`, also the profiling harness's; ``logging`` is the rest of the step).
At the end of the window rank 0 prints their time per step and the top operators by self time. On a CUDA device
the caching allocator's history is recorded over the window and dumped beside the trace
(``rank{R}.memory.pickle``, https://pytorch.org/memory_viz), and an out-of-memory error in any step
dumps the allocator's state to ``SAVE_DIR/profile/oom_step_N/rank{R}.memory.pickle`` before it is
raised again. Outside the window nothing is traced or recorded (:func:`phase` is a null context).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from megahash.accelerator import measurement

PHASES = ("data", "forward", "backward", "optimizer", "logging")  # of a step (also megahash.training.profiling's)
PREFIX = "megahash/"
STEP = "ProfilerStep#"  # what torch.profiler's own step() names a step (key_averages() merges them as "ProfilerStep*")
TOP_OPS = 10
_NULL = contextlib.nullcontext()


def phase(name: str):
    """A ``record_function`` range ``megahash/NAME`` while a profiler runs, else a null context (no
    cost outside a profiled window)."""
    return torch.profiler.record_function(PREFIX + name) if torch.autograd._profiler_enabled() else _NULL


def phase_table(seconds: dict[str, float], unit: str) -> str:
    """Markdown table of seconds per phase (:data:`PHASES`, then ``step``): milliseconds and share of the step."""
    total = seconds.get("step", 0.0) or 1.0
    lines = [f"| phase | {unit} | share |", "| --- | --- | --- |"]
    for k in (*PHASES, "step"):
        if k in seconds:
            lines.append(f"| {k} | {seconds[k] * 1e3:.1f} | {100 * seconds[k] / total:.0f}% |")
    return "\n".join(lines)


class StepProfiler:
    """``torch.profiler`` over the steps ``train.profile_steps`` of one rank, and the out-of-memory dump.

    ``with profiler.step(n):`` wraps the whole of step ``n`` (1-based): the window opens before its
    first step and closes after its last (or at :meth:`close`, when the run stops inside it)."""

    def __init__(self, cfg, rank: int, write=print):
        steps = list(cfg.train.profile_steps or [])
        self.start, self.end = (steps[0], steps[1]) if steps else (0, -1)
        self.rank, self.write = rank, write
        self.root = Path(cfg.train.save_dir) / "profile"
        self.prof = None
        self.memory = False  # recording the allocator's history (CUDA)
        self.done: list[int] = []  # the steps traced so far

    @contextlib.contextmanager
    def step(self, n: int):
        if n == self.start:
            self._open()
        try:
            with torch.profiler.record_function(f"{STEP}{n}") if self.prof is not None else _NULL:
                yield
        except torch.OutOfMemoryError:
            self._dump_oom(n)
            raise
        if self.prof is not None:
            self.done.append(n)
            if n >= self.end:
                self.close()

    def _open(self) -> None:
        from torch.profiler import profile

        self.memory = measurement.record_memory_history(True)
        self.prof = profile(activities=measurement.profiler_activities(), record_shapes=True)
        self.prof.start()

    def close(self) -> None:
        """Stop the profiler (if it runs), write this rank's trace and memory snapshot; rank 0 prints
        the phase and top-operator tables."""
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.stop()
        if not self.done:
            return
        out = self.root / f"steps_{self.done[0]}-{self.done[-1]}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{self.rank}.pt.trace.json"))
        if self.memory:
            measurement.dump_memory_snapshot(out / f"rank{self.rank}.memory.pickle")
            measurement.record_memory_history(False)
            self.memory = False
        if self.rank == 0:
            self.write(summary(prof.key_averages(), len(self.done), out))

    def _dump_oom(self, n: int) -> None:
        """The allocator's state at an out-of-memory error of step ``n`` (CUDA; nothing on CPU)."""
        path = self.root / f"oom_step_{n}" / f"rank{self.rank}.memory.pickle"
        if measurement.dump_memory_snapshot(path):
            print(
                f"megahash: out of memory at step {n} on rank {self.rank}; memory snapshot {path} "
                f"(open at https://pytorch.org/memory_viz)",
                flush=True,
            )


def phase_seconds(averages, steps: int) -> dict[str, float]:
    """Seconds per step of each phase (host time of the ``megahash/`` ranges; ``logging`` = the step
    minus the other phases) and of the whole step, from ``key_averages()`` of ``steps`` steps."""
    total = {e.key: e.cpu_time_total * 1e-6 for e in averages if e.key.startswith((PREFIX, STEP[:-1]))}
    step = sum(v for k, v in total.items() if k.startswith(STEP[:-1])) / steps
    out = {p: total.get(PREFIX + p, 0.0) / steps for p in PHASES if p != "logging"}
    out["logging"] = max(step - sum(out.values()), 0.0)
    out["step"] = step
    return out


def top_ops(averages, steps: int, rows: int = TOP_OPS) -> str:
    """Table of the operators with the most self time per step (device time where a device was traced)."""
    ops = [e for e in averages if not e.key.startswith((PREFIX, STEP[:-1]))]
    device = any(e.self_device_time_total > 0 for e in ops)
    key = (lambda e: e.self_device_time_total) if device else (lambda e: e.self_cpu_time_total)
    lines = [
        "| op | self CPU ms/step | self device ms/step | calls/step |"
        if device
        else "| op | self CPU ms/step | calls/step |"
    ]
    lines.append("| --- " * (lines[0].count("|") - 1) + "|")
    for e in sorted(ops, key=key, reverse=True)[:rows]:
        dev = f" {e.self_device_time_total * 1e-3 / steps:.2f} |" if device else ""
        lines.append(f"| {e.key} | {e.self_cpu_time_total * 1e-3 / steps:.2f} |{dev} {e.count / steps:g} |")
    return "\n".join(lines)


def summary(averages, steps: int, where: Path) -> str:
    """Rank 0's report of a profiled window: where the traces are, the phases, the top operators."""
    return (
        f"megahash: profiled {steps} step(s), traces in {where}/ (rank R: rankR.pt.trace.json)\n"
        f"{phase_table(phase_seconds(averages, steps), 'ms/step')}\n"
        f"top operators by self time:\n{top_ops(averages, steps)}"
    )
