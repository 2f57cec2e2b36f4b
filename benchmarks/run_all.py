#!/usr/bin/env python
"""Run every megahash benchmark and write one dated markdown report labelled with the machine.

    python benchmarks/run_all.py [--quick] [--out benchmarks/results]

Each benchmark measures its baseline in the same run and prints ratios against it (data stage vs
plain tokenise+write, hash embeddings vs ``vocab``, attention kinds vs ``mha``, training steps vs
the standard model of the same size). The report ``benchmarks/results/YYYY-MM-DD_<machine>.md``
holds each benchmark's table and the machine facts (CPU/GPU, cores, torch). ``--quick`` runs
smaller settings (minutes on a 2-core CPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform as pyplatform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BENCHES = {
    "data stage (tokens/s vs tokenise+IndexedDatasetBuilder)": (
        ["bench_preprocess.py", "--hashes", "md5,lsh128", "--workers", "2"],
        ["bench_preprocess.py", "--hashes", "md5,lsh128", "--workers", "2", "--repeats", "1", "--max-docs", "1000"],
    ),
    "data stage, one worker": (
        ["bench_preprocess.py", "--hashes", "md5,lsh128", "--workers", "1"],
        ["bench_preprocess.py", "--hashes", "md5,lsh128", "--workers", "1", "--repeats", "1", "--max-docs", "1000"],
    ),
    "embeddings (fwd+bwd time and memory vs vocab)": (
        ["bench_embeddings.py"],
        ["bench_embeddings.py", "--tokens", "2048", "--iters", "3", "--no-memory"],
    ),
    "attention (fwd+bwd vs mha; decode step vs context)": (
        ["bench_attention.py"],
        ["bench_attention.py", "--seqs", "256", "--contexts", "128,512", "--reps", "1", "--steps", "2"],
    ),
    "training step (tokens/s, MFU vs the standard model)": (
        ["bench_training.py", "--sizes", "tiny,70m,160m,500m"],
        ["bench_training.py", "--sizes", "tiny", "--steps", "3", "--seq", "128", "--compile", "both"],
    ),
    "training step vs the plain transformers loop (tokens/s ratio)": (
        ["bench_vs_transformers.py"],
        ["bench_vs_transformers.py", "--shapes", "small", "--rounds", "2", "--steps", "3", "--warmup", "1"],
    ),
}


def machine() -> str:
    import torch

    cpu = pyplatform.processor() or pyplatform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores; {gpu}; torch {torch.__version__}; Python {pyplatform.python_version()}"


def merge_sections(old: str, new: str) -> str:
    """The old report with each ``## title`` section that ``new`` has replaced by the new one
    (sections new to the report are appended; the header and machine line are the new ones)."""

    def split(text):
        head, *rest = text.split("\n## ")
        return head, {sec.split("\n", 1)[0]: "## " + sec for sec in rest}

    _, old_secs = split(old)
    head, new_secs = split(new)
    merged = {**old_secs, **new_secs}
    return head + "\n" + "".join(sec if sec.endswith("\n") else sec + "\n" for sec in merged.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--only", default="", help="comma-separated substrings of benchmark titles")
    args = ap.parse_args(argv)
    label = machine()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", label.split(";")[1].strip() if "no GPU" not in label else "cpu").strip("-")
    out = Path(args.out) / f"{datetime.date.today().isoformat()}_{slug}{'_quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    parts = [
        f"# megahash benchmarks, {datetime.date.today().isoformat()}",
        "",
        f"Machine: {label}",
        "",
        "Every ratio is against a baseline measured in the same run (see each benchmark's docstring).",
        "",
    ]
    status = 0
    for title, (full, quick) in BENCHES.items():
        if args.only and not any(s in title for s in args.only.split(",")):
            continue
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks" / (quick if args.quick else full)[0]),
            *(quick if args.quick else full)[1:],
        ]
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        took = time.time() - t0
        print(f"{title}: exit {r.returncode} in {took:.0f} s", flush=True)
        status |= r.returncode
        body = r.stdout.strip() if r.returncode == 0 else (r.stdout + r.stderr)[-3000:]
        parts += [f"## {title}", "", f"`{' '.join(cmd[1:]).replace(str(ROOT) + '/', '')}` ({took:.0f} s)", "", body, ""]
    text = "\n".join(parts) + "\n"
    if args.only and out.is_file():  # keep the sections of the day's report that were not rerun
        text = merge_sections(out.read_text(), text)
    from megahash.atomic_write import write_text_atomic

    write_text_atomic(out, text)
    print(f"report: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
