"""Training progress on rank 0: step/total, tokens/s and ETA.

On a terminal (stderr is a TTY) a tqdm bar; otherwise (logs, SLURM, CI) one line every
``train.log_interval`` steps, e.g. ``[train] step 20/300 loss 5.61 ... tokens/s 9.1e+03 eta 2m13s``.
``MEGAHASH_PROGRESS=lines`` forces lines on a terminal. Other ranks print nothing.
"""

from __future__ import annotations

import os
import sys
import time


def format_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_line(prefix: str, step: int, total: int, metrics: dict, eta: float | None = None) -> str:
    parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    tail = f" eta {format_eta(eta)}" if eta is not None else ""
    return f"[{prefix}] step {step}/{total} {parts}{tail}"


class Progress:
    def __init__(self, total: int, start: int, rank: int):
        self.active = rank == 0
        self.total, self.start = total, start
        self.t0 = time.perf_counter()
        self.bar = None
        if not self.active or os.environ.get("MEGAHASH_PROGRESS", "auto") == "lines" or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def eta(self, step: int) -> float:
        done = step - self.start
        if done <= 0:
            return float("nan")
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    def update(self, step: int, metrics: dict, echo: bool) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(
                loss=f"{metrics.get('loss', float('nan')):.4f}",
                tok_s=f"{metrics.get('tokens_per_s', 0.0):.3g}",
                refresh=False,
            )
            if echo and step > 1:
                self.bar.write(format_line("train", step, self.total, metrics, self.eta(step)), file=sys.stdout)
            return
        if echo:
            print(format_line("train", step, self.total, metrics, self.eta(step)), flush=True)

    def write(self, line: str) -> None:
        """A line that does not break the bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
