#!/usr/bin/env python
"""The training stall per checkpoint save, ``train.async_save=true`` against the synchronous save.

    python benchmarks/bench_async_save.py [--models tiny,70m] [--steps 16] [--save-interval 4] [--out FILE]

One rank (``python megahash/pretrain.py``, DeepSpeed ZeRO-1 engine on the CPU), the same run twice per
model, synchronous then asynchronous, on Shakespeare shards built here with the data tools. Each save
writes a ``checkpoint`` record to metrics.jsonl (megahash/training/async_save.py): ``stall_s`` is
the time the step loop was blocked by that save (synchronous: the whole save; asynchronous: planning,
gathering and forking the writers, plus the finalization and publication at the poll that found
them done, plus any wait for them). Also reported: the loop's wall time from step 1 to the last step
(the background writers share the CPU with training) and the save's size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {  # quickstart-like: configs/quickstart.yaml's tiny decoder; 70m: [Xue25] Table 4.10's 70M
    "tiny": ["--config", "configs/quickstart.yaml", "train.global_batch_size=8"],
    "70m": [
        "--config",
        "configs/quickstart.yaml",
        "--config",
        "configs/model/70m.yaml",
        "train.micro_batch_size=2",
        "train.global_batch_size=2",
    ],
}


def shards(d: Path) -> tuple[str, str]:
    py = sys.executable
    subprocess.run(
        [
            py,
            "data_tools/train_tokenizer.py",
            "--input",
            "shakespeare",
            "--output",
            str(d / "spm"),
            "--vocab-size",
            "1000",
            "--max-docs",
            "200",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            py,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(d / "shk"),
            "--tokenizer",
            str(d / "spm.model"),
            "--max-docs",
            "400",
            "--quiet",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return str(d / "shk"), str(d / "spm.model")


def run(model: str, mode: bool, d: Path, data: tuple[str, str], steps: int, every: int) -> dict:
    save_dir = d / f"{model}_{'async' if mode else 'sync'}"
    cmd = [
        sys.executable,
        "megahash/pretrain.py",
        *MODELS[model],
        f"data.prefix=[{data[0]}]",
        f"data.tokenizer={data[1]}",
        f"train.steps={steps}",
        f"train.save_interval={every}",
        "train.keep_last=1",
        "train.eval_interval=0",
        "train.log_interval=1000",
        "logging.plot=false",
        "logging.tensorboard=false",
        f"train.save_dir={save_dir}",
        f"train.async_save={str(mode).lower()}",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(line) for line in (save_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if x["split"] == "train"]
    saves = [x for x in recs if x["split"] == "checkpoint"]
    ckpt = save_dir / (save_dir / "latest").read_text()
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    return {
        "stalls": [x["stall_s"] for x in saves],
        "writes": [x.get("write_s") for x in saves],
        "loop_s": train[-1]["time"] - train[0]["time"],
        "step_s": statistics.median(x["step_time_s"] for x in train),
        "mib": size / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,70m")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--save-interval", type=int, default=4)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lines = [
        "| model | save | stall per save, s (each save) | median | write, s (async: start to publish) "
        "| loop step 1 -> last, s | median step, s | checkpoint MiB |",
        "|" + " --- |" * 8,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        data = shards(d)
        for model in a.models.split(","):
            for mode in (False, True):
                m = run(model, mode, d, data, a.steps, a.save_interval)
                w = "-" if not mode else ", ".join(f"{x:.2f}" for x in m["writes"])
                lines.append(
                    f"| {model} | {'async' if mode else 'sync'} | {', '.join(f'{x:.2f}' for x in m['stalls'])} "
                    f"| {statistics.median(m['stalls']):.2f} | {w} | {m['loop_s']:.1f} | {m['step_s']:.3f} "
                    f"| {m['mib']:.0f} |"
                )
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
