#!/usr/bin/env python
"""Cost of the loader's range checks (megahash/data/token_check.py, issue 47): ``HashGPTDataset.__getitem__``
with the token-id and code checks against the same dataset with ``check_range`` replaced by a no-op.

    python benchmarks/bench_token_check.py [--seq 128,2048] [--samples 2000] [--repeats 5] [--out FILE]

Shards: the first 400 Shakespeare documents, a 1,000-piece lossy BPE, side shards md5 and md5-bucket64
(a bucket spec: its codes are checked too); the dataset is megatron-core's GPTDataset built by
``build_datasets`` with the model reading ``md5-bucket64`` (``hash-emb``). One process, one thread;
per sequence length, ``--repeats`` passes over the same samples alternate between checked and unchecked;
the best pass of each is reported (CPU µs per sample) and their difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(tmp: Path) -> tuple[str, str]:
    from megahash.data.preprocess import preprocess_data, train_tokenizer

    tok = tmp / "spm"
    assert (
        train_tokenizer.main(
            [
                "--input",
                "shakespeare",
                "--output",
                str(tok),
                "--vocab-size",
                "1000",
                "--max-docs",
                "150",
                "--quiet",
                "--lossy",
            ]
        )
        == 0
    )
    prefix = tmp / "shk"
    assert (
        preprocess_data.main(
            [
                "--input",
                "shakespeare",
                "--output-prefix",
                str(prefix),
                "--tokenizer",
                f"{tok}.model",
                "--word-hashes",
                "md5,md5-bucket64",
                "--max-docs",
                "400",
                "--quiet",
            ]
        )
        == 0
    )
    return str(prefix), f"{tok}.model"


def passes(ds, n: int) -> float:
    """CPU µs per sample of this process (``time.process_time``: on a shared machine the wall clock counts
    other jobs' time slices; the loader's work here is all in this thread)."""
    t = time.process_time()
    for i in range(n):
        ds[i]
    return (time.process_time() - t) / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="128,2048")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from megahash.config import load_config
    from megahash.data import dataset as dataset_module

    checked = dataset_module.check_range
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_token_check_") as d:
        prefix, tok = build(Path(d))
        for seq in [int(s) for s in args.seq.split(",")]:
            cfg = load_config(
                "configs/quickstart.yaml",
                [
                    f"data.prefix=[{prefix}]",
                    f"data.tokenizer={tok}",
                    f"data.seq_length={seq}",
                    "model.embedding=hash-emb",
                    "model.embed.hash_spec=md5-bucket64",
                    "data.split=100,0,0",
                    f"model.max_position_embeddings={max(seq, 256)}",
                ],
            )
            data = dataset_module.build_datasets(cfg, args.samples, 0, str(Path(d) / f"cache{seq}"))
            ds = data.train
            n = min(args.samples, len(ds))
            passes(ds, n)  # warm: the index files are mapped and read once
            on, off = [], []
            for _ in range(args.repeats):
                dataset_module.check_range = checked
                on.append(passes(ds, n))
                dataset_module.check_range = lambda *a, **k: None
                off.append(passes(ds, n))
            dataset_module.check_range = checked
            rows.append((seq, n, min(off), min(on)))
    lines = [
        "| seq | samples | unchecked µs/sample | checked µs/sample | cost µs | cost % |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seq, n, off, on in rows:
        lines.append(f"| {seq} | {n} | {off:.1f} | {on:.1f} | {on - off:.1f} | {100 * (on - off) / off:.1f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
