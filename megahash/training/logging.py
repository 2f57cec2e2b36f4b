"""Run logging: stdout lines, ``metrics.jsonl``, TensorBoard and wandb (offline unless configured),
and the loss-curve PNG at the end.

One history after a resume: a run that starts at step k (resumed from the checkpoint of step k, or
from scratch: k = 0) continues the logs of the run directory as if the steps after k had never been
logged. :func:`keep_history` rewrites ``metrics.jsonl`` atomically without the records of a killed
run past k (rewritten rather than marked: every reader, pandas and ``jq`` included, sees one record
per step, in order); TensorBoard's writer starts with ``purge_step`` at the first x value after k,
so TensorBoard hides the killed run's later events; W&B's history cannot be truncated (its rewind
is a private preview), so the same W&B run continues (``resume="allow"``, its id in
``RUN_DIR/wandb_run_id``) and the steps the killed run already sent are not sent again: W&B drops a
step below its last one with a warning anyway. There those steps keep the killed run's values,
which are the same bits at the same layout (resume is bit-exact) and differ by rounding after a
resume at another layout (docs/resume.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class RunLogger:
    """Rank 0 writes; other ranks no-op. ``start``: the step the run starts at (the module docstring:
    what was logged past it is dropped)."""

    def __init__(self, cfg, rank: int, start: int = 0):
        self.active = rank == 0
        self.dir = Path(cfg.train.save_dir)
        self.cfg = cfg
        self.tb = None
        self.wandb = None
        self.sent = 0  # W&B holds the steps up to here from a killed run: not sent again
        self.failed: OSError | None = None  # metrics.jsonl could not be written (disk full): the run stops
        if not self.active:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sent = keep_history(self.dir / "metrics.jsonl", start)
        self.jsonl = open(self.dir / "metrics.jsonl", "ab", buffering=0)  # one write per record (_append)
        lg = cfg.logging
        if lg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                wait_for_a_later_second(self.dir / "tensorboard")
                self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=purge_step(cfg, start))
            except Exception as e:  # tensorboard missing: keep going with the other sinks
                print(f"warning: tensorboard disabled ({e})")
        if lg.wandb and lg.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            # a requeued/resumed run continues the same wandb run: its id lives in the run directory
            self.wandb = wandb.init(
                project=lg.wandb_project,
                name=lg.run_name or self.dir.name,
                mode=lg.wandb_mode,
                dir=str(self.dir),
                config=cfg.to_dict(),
                resume="allow",
                id=wandb_run_id(self.dir),
            )
            x = X_AXIS_KEYS.get(getattr(lg, "x_axis", "step"))
            if x:
                self.wandb.define_metric("*", step_metric=f"train/{x}")

    def log(self, step: int, metrics: dict, prefix: str = "train", echo: bool = True, late: bool = False) -> None:
        """One record at ``step``; ``late``: a step the run has passed (a background evaluation,
        megahash/training/eval_during.py): W&B's own step only increases, so there it is ``PREFIX/step``."""
        if not self.active:
            return
        rec = {"step": step, "split": prefix, "time": time.time(), **metrics}
        self._append((json.dumps(rec) + "\n").encode())
        if self.tb:
            x = int(metrics.get(X_AXIS_KEYS.get(getattr(self.cfg.logging, "x_axis", "step")) or "", step))
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{prefix}/{k}", v, x)
            if prefix == "checkpoint":  # on disk with each checkpoint (the writer's own flush waits 120 s): a
                self.tb.flush()  # killed run's events up to its newest checkpoint survive, its purge marker first
        if self.wandb and late:
            self.wandb.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
            self.wandb.log({f"{prefix}/{k}": v for k, v in {**metrics, "step": step}.items()})
        elif self.wandb and step > self.sent:
            self.wandb.log({f"{prefix}/{k}": v for k, v in metrics.items()}, step=step)
        if not echo:
            return
        parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        print(f"[{prefix}] step {step} {parts}", flush=True)

    def _append(self, line: bytes) -> None:
        """One record onto ``metrics.jsonl``, whole or not at all: a write the file system refuses (disk full,
        quota, I/O error) is cut off again and remembered in ``failed`` (the trainer stops every rank at the
        step's end, megahash/training/trainer.py); nothing more is written after it."""
        if self.failed is not None:
            return
        fd = self.jsonl.fileno()
        size = os.fstat(fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as e:
            self.failed = e if e.filename else OSError(e.errno, e.strerror, str(self.dir / "metrics.jsonl"))
            try:
                os.ftruncate(fd, size)  # no half record: the history stays whole lines
            except OSError:
                pass

    def close(self) -> None:
        if not self.active:
            return
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


# logging.x_axis -> the metric TensorBoard/wandb plot against (step when absent)
X_AXIS_KEYS = {"step": None, "tokens": "consumed_tokens", "samples": "consumed_samples"}


def wait_for_a_later_second(folder: Path, most: float = 2.0) -> None:
    """Before a new TensorBoard writer in ``folder``: wait (at most ``most`` s) until the clock's second is past
    every event file's there. TensorBoard reads a folder's files in name order, and a name starts with the second
    its writer was made (``events.out.tfevents.SECOND.HOST.PID.N``): a run resumed within the second its killed
    predecessor started logging sorted by pid, and read after it, the killed run's purge marker hid the resumed
    run's steps (seen in CI, a tiny model's run killed and resumed within a second)."""
    seconds = []
    for f in folder.glob("events.out.tfevents.*") if folder.is_dir() else ():
        stamp = f.name.split(".")[3]
        if stamp.isdigit():
            seconds.append(int(stamp))
    deadline = time.time() + most
    while seconds and int(time.time()) <= max(seconds) and time.time() < deadline:
        time.sleep(0.02)


def purge_step(cfg, start: int) -> int:
    """TensorBoard's ``purge_step`` of a run starting at step ``start``: the x value (logging.x_axis) of
    its first record; the events at or past it are a killed run's (TensorBoard hides them)."""
    from megahash.data.samples import consumed_samples

    key = X_AXIS_KEYS.get(getattr(cfg.logging, "x_axis", "step"))
    if key is None:
        return start + 1
    samples = consumed_samples(cfg.train, start)
    return (samples * cfg.data.seq_length if key == "consumed_tokens" else samples) + 1


def _record_step(rec: dict) -> int:
    """The step a record belongs to: a checkpoint's publication by the step it saved (an asynchronous
    save is published steps later), every other record by its step."""
    return int(rec.get("saved_step", rec["step"]))


def keep_history(path: Path, start: int) -> int:
    """Drop the records of ``metrics.jsonl`` past step ``start`` (a killed run's, to be logged again),
    and a line a kill cut short, rewriting the file atomically when anything goes; returns the last
    step the dropped records reached (0: none). Read from the end: every record written before the
    train record of step ``start`` belongs to a step up to ``start`` (a late evaluation's or a
    publication's record carries an earlier step), so a long history is not parsed at each start."""
    if not path.is_file() or not path.stat().st_size:
        return 0
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _drop_past(path, data, start)


def _drop_past(path: Path, data, start: int) -> int:
    """keep_history over the bytes ``data`` of ``path`` (a memory map)."""
    tail, end = [], len(data)
    while end > 0:  # lines from the last, until the train record of a step up to start
        begin = data.rfind(b"\n", 0, end - 1) + 1
        line = data[begin:end]
        try:
            rec = json.loads(line)
            step = _record_step(rec)
            int(rec["step"])  # read again below for a dropped record
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # RecursionError: nested too deep
            rec, step = None, None
        if rec is not None and rec.get("split") == "train" and step <= start:
            break
        tail.append((line, rec, step))
        end = begin
    keep, last, dropped = [], 0, False
    for line, rec, step in reversed(tail):
        if rec is not None and step <= start:
            keep.append(line if line.endswith(b"\n") else line + b"\n")
        elif rec is not None:
            dropped, last = True, max(last, int(rec["step"]))
        else:
            dropped = dropped or bool(line.strip())
    if dropped:
        from megahash.atomic_write import write_bytes_atomic

        write_bytes_atomic(path, data[:end] + b"".join(keep))
    return last


def wandb_run_id(run_dir: str | Path) -> str:
    """The run's wandb id, created once and stored in ``RUN_DIR/wandb_run_id`` (atomic write)."""
    path = Path(run_dir) / "wandb_run_id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    import secrets

    from megahash.atomic_write import write_text_atomic

    run_id = secrets.token_hex(4)
    write_text_atomic(path, run_id + "\n")
    return run_id


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl`` (JSON objects; any other line, e.g. one damaged before the
    step a run resumed at, which :func:`keep_history` does not read, is passed over: it was a traceback at
    the end of a finished run, from the loss plot, and made the grid report drop every curve of the run)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def loss_points(rec: dict):
    """(split, step, loss) of a train or validation record with a whole step and a numeric loss, else None."""
    step, loss = rec.get("step"), rec.get("loss")
    if isinstance(step, int) and isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return str(rec.get("split")), step, loss
    return None


def plot_loss(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Train and validation loss (every set) against step -> ``loss_curve.png`` (last record of a step wins,
    so resumed runs plot once)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    series: dict[str, dict[int, float]] = {"train": {}, "valid": {}}
    for point in filter(None, map(loss_points, recs)):  # every validation set by name (valid/NAME: data.valid) too
        split, step, loss = point
        if split in series or split.startswith("valid/"):
            series.setdefault(split, {})[step] = loss
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, pts in series.items():
        if pts:
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o" if name.startswith("valid") else None, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(Path(run_dir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out) if out else Path(run_dir) / "loss_curve.png"
    from megahash.atomic_write import write_figure_atomic

    fig.tight_layout()
    write_figure_atomic(fig, out)  # a job killed while plotting leaves the old PNG
    plt.close(fig)
    return out
