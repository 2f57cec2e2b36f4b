"""Conditioning of approx-thesis's first order (eq. 4.16) against the positive denominator (issue 33).

Random unit-variance q, k, v ([1, heads, 1, L, d], fp64) through ``orders_causal`` literally and with
``positive=True``: the output's size (max, median |o|, rms(o)/rms(v)), the largest fp64 gradient of
sum(o * w) (w unit normal) with respect to q, k, v, and the relative error ||o - o64|| / ||o64|| of fp32
inputs, of bf16 inputs (fp32 accumulation, bf16 output) and of the exact (fp64) result on the
bf16-rounded inputs (what rounding q, k, v to bf16 alone costs: the conditioning, any arithmetic).

    PYTHONPATH=. python benchmarks/bench_thesis_conditioning.py [--lengths 1024,4096] [--heads 4] [--dim 32]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megahash.ops.orders.chunk import orders_causal


def rel(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def row(L: int, heads: int, d: int, positive: bool) -> str:
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(1, heads, 1, L, d, generator=g, dtype=torch.float64) for _ in range(4))
    qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
    o = orders_causal(qq, kk, vv, positive=positive)[0]
    (o * w).sum().backward()
    grad = max(float(t.grad.abs().max()) for t in (qq, kk, vv))
    o = o.detach()
    f32 = orders_causal(q.float(), k.float(), v.float(), positive=positive)[0]
    b16 = orders_causal(q.bfloat16(), k.bfloat16(), v.bfloat16(), positive=positive)[0]
    rounded = orders_causal(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), positive=positive)[0]
    ratio = float(o.pow(2).mean().sqrt() / v.pow(2).mean().sqrt())
    return (
        f"| {'positive' if positive else 'literal'} | {L} | {float(o.abs().max()):.3g} | {float(o.abs().median()):.3g} "
        f"| {ratio:.3g} | {grad:.3g} | {rel(f32, o):.2e} | {rel(b16, o):.2e} | {rel(rounded, o):.2e} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    a = p.parse_args(argv)
    print(
        f"`python benchmarks/bench_thesis_conditioning.py {' '.join(argv or sys.argv[1:])}` "
        f"(heads {a.heads}, d {a.dim}, unit-normal q, k, v, w)\n"
    )
    print(
        "| denominator | L | max abs(o) | median abs(o) | rms(o)/rms(v) | max fp64 grad | fp32 rel. err "
        "| bf16 inputs rel. err | exact on bf16-rounded inputs |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for L in map(int, a.lengths.split(",")):
        for positive in (False, True):
            print(row(L, a.heads, a.dim, positive), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
