"""Packed documents, linear/recurrent and fixed-Q/K kinds (issue 34) on CPU: ATen calls of one attention
module's forward + backward with 1, 8 and 32 documents per row, and its fwd+bwd time with document ids (8 per
row) against the same module without (ratio, the two interleaved step by step in one run).

    python3 benchmarks/bench_packed_documents_linear.py [--kinds approx,...] [--seq 1024] [--batch 2] [--reps 5]

Module level (one attention sublayer, h 128, 4 heads, fp32, one thread), built as tests/models/test_attention.py
builds it; fixed-Q/K kinds with random frozen maps. Times are medians of ``--reps`` steps after a warm-up."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path[:0] = [os.path.join(ROOT, "tests", "models"), os.path.join(ROOT, "tests")]  # test_attention's builders

import torch

from megahash.models.forward_state import ForwardState
from megahash.training.op_count import CountOps


def ids(batch, seq, docs):
    bounds = [(i + 1) * seq // docs for i in range(docs)]
    row = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(zip([0] + bounds[:-1], bounds))])
    return row.expand(batch, -1).clone()


def module(kind, seq):
    from test_attention import build_attention, make_cfg

    from megahash.models.attention.fixed_qk import FixedInput

    m = build_attention(make_cfg(kind, hidden=128, heads=4, layers=1))
    inputs = {}
    if kind in ("rndembqk", "fixedseqqk"):  # frozen maps, as the fixed input hands them to its layers
        g = torch.Generator().manual_seed(0)
        inputs[FixedInput.attr] = {
            m.layer_number: (torch.randn(seq, 1, 4, 32, generator=g), torch.randn(seq, 1, 4, 32, generator=g))
        }
    return m, inputs


def step(module_inputs, x, doc):
    m, inputs = module_inputs
    xx = x.detach().requires_grad_(True)
    m.mix(xx, None, None, ForwardState(document_ids=doc, inputs=inputs)).square().mean().backward()


def measure(kind, seq, batch, reps):
    m = module(kind, seq)
    x = torch.randn(seq, batch, 128)
    calls = {}
    for docs in (1, 8, 32):
        doc = ids(batch, seq, docs)
        with CountOps() as c:
            step(m, x, doc)
        calls[docs] = c.total()
    doc8 = ids(batch, seq, 8)
    t = {"ids": [], "none": []}
    step(m, x, doc8), step(m, x, None)
    for _ in range(reps):
        for key, d in (("ids", doc8), ("none", None)):
            t0 = time.perf_counter()
            step(m, x, d)
            t[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "kind": kind,
        "calls": calls,
        "ms_ids": 1e3 * med["ids"],
        "ms_none": 1e3 * med["none"],
        "ratio": med["ids"] / med["none"],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kinds", default="approx,approx-thesis,nonapprox,mlp,rndembqk")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    from megahash.accelerator import process_groups

    process_groups.init_distributed(1)
    print(f"seq {a.seq}, batch {a.batch}, h 128, 4 heads, fp32, 1 thread, torch {torch.__version__}")
    print("| kind | ATen calls fwd+bwd (1 / 8 / 32 documents per row) | ms with ids (8 docs) | ms without | ratio |")
    print("|---|---|---|---|---|")
    for kind in a.kinds.split(","):
        if kind == "staticembqk":
            continue  # its Q, K need the model's layer-0 embeddings: docmask's benchmark covers it at model level
        r = measure(kind, a.seq, a.batch, a.reps)
        c = r["calls"]
        print(
            f"| {kind} | {c[1]} / {c[8]} / {c[32]} | {r['ms_ids']:.1f} | {r['ms_none']:.1f} | {r['ratio']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
