#!/usr/bin/env python
"""Peak resident size of data_tools/preprocess_data.py on inputs shaped to take memory (issue 47 item 4;
the bound is in docs/data.md#memory): one line of ``--line-mb`` MB without a newline, and
``--tiny-docs`` two-character documents, each for a lossy and a lossless sentencepiece BPE and the
HashFormers ``words`` tokenizer, ``--word-hashes md5``, ``--workers 1``, default limits.

    python benchmarks/bench_preprocess_memory.py [--line-mb 50] [--tiny-docs 8000000] [--root DIR] [--out FILE]

``--root``: the checkout whose ``data_tools/preprocess_data.py`` runs (default this one; another
checkout gives the "before" column). The peak is the kernel's ``ru_maxrss`` of the command's process
(``os.wait4``: the largest of it and the children it waited for), not sampled. Tokenizers are trained
by this checkout (1,000 pieces on 150 Shakespeare documents), so both columns read the same files.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
UNIT = "The quick brown fox, said Hamlet, jumps over the lazy dog; and the rest is silence. "


def peak(root: Path, args: list[str]) -> tuple[int, float, str]:
    """(peak resident bytes, seconds, last error line or "") of preprocess_data.py of ``root``."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "data_tools/preprocess_data.py", *args],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    rc = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - t, "" if rc == 0 else f"exit {rc}: {err[-1] if err else ''}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--line-mb", type=int, default=50)
    p.add_argument("--tiny-docs", type=int, default=8_000_000)
    p.add_argument("--root", default=str(ROOT))
    p.add_argument("--tokenizers", default="lossy,lossless,words")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from megahash.data.preprocess import train_tokenizer

    root = Path(args.root).resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_memory_") as d:
        tmp = Path(d)
        toks = {}
        for name in args.tokenizers.split(","):
            if name == "words":
                toks[name] = "words"
                continue
            extra = ["--lossy"] if name == "lossy" else []
            assert (
                train_tokenizer.main(
                    [
                        "--input",
                        "shakespeare",
                        "--output",
                        str(tmp / name),
                        "--vocab-size",
                        "1000",
                        "--max-docs",
                        "150",
                        "--quiet",
                        *extra,
                    ]
                )
                == 0
            )
            toks[name] = str(tmp / f"{name}.model")
        line = tmp / "line.txt"
        reps = args.line_mb * 1_000_000 // len(UNIT)
        with open(line, "w") as f:
            for _ in range(reps // 4096):
                f.write(UNIT * 4096)
            f.write(UNIT * (reps % 4096))
        inputs = {f"one line of {args.line_mb} MB": line}
        if args.tiny_docs:
            tiny = tmp / "tiny.txt"
            with open(tiny, "w") as f:
                for _ in range(args.tiny_docs // 100_000):
                    f.write("ab\n" * 100_000)
            inputs[f"{args.tiny_docs:,} two-character lines (--txt-mode lines)"] = tiny
        for what, path in inputs.items():
            for name, tok in toks.items():
                if "two-character" in what and name != "lossy":
                    continue
                mode = ["--txt-mode", "lines"] if "two-character" in what else []
                out = tmp / f"out_{name}"
                rss, secs, err = peak(
                    root,
                    [
                        "--input",
                        str(path),
                        "--output-prefix",
                        str(out),
                        "--tokenizer",
                        tok,
                        "--word-hashes",
                        "md5",
                        "--workers",
                        "1",
                        "--quiet",
                        "--overwrite",
                        *mode,
                    ],
                )
                rows.append((what, name, rss, secs, err))
                print(f"{what} | {name} | {rss / 2**20:.0f} MiB | {secs:.1f} s {err}", flush=True)
    lines = [
        f"root: {root}",
        "",
        "| input | tokenizer | peak resident MiB | seconds | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {w} | {n} | {r / 2**20:.0f} | {s:.1f} | {e} |" for w, n, r, s, e in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
