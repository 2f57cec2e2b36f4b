"""Incremental decoding of every attention kind (issue 26 item 6): tokens/s and decode-cache memory
after a context of 2K, 8K and 32K tokens, on the small model of ``bench_kinds_cpu.py``.

The context is prefilled through the decode cache in pieces of ``--piece`` tokens (bounded memory),
then ``--steps`` single-token steps are timed (median). Cache memory is the bytes of every tensor in
the model's per-layer decode caches: softmax kinds keep keys and values (grows with the context),
the linear kinds a state whose size does not depend on it (approx: S, z; approx-thesis: s0..z2;
nonapprox: m, num, den). Kinds whose prefill would form a map larger than ``--max-map-gb`` (the
fixed-Q/K kinds' one L x T map per piece) are skipped at that context.

    PYTHONPATH=. python benchmarks/bench_decode.py [--kinds mha,approx] [--contexts 2048,8192,32768] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megahash.accelerator import process_groups


def cache_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for c in state.caches for t in c.values() if torch.is_tensor(t))


@torch.no_grad()
def decode(model, context: int, steps: int, piece: int) -> tuple[float, int]:
    """(median seconds of one token step, cache bytes after the context) of one sequence."""
    from bench_kinds_cpu import VOCAB

    from megahash.models.megatron_model import DecodeState

    model.eval()
    tok = torch.randint(0, VOCAB, (1, context + steps), generator=torch.Generator().manual_seed(context))
    state = DecodeState(len(model.decoder.layers))
    for start in range(0, context, piece):
        model.logits(model.hidden_states(tok[:, start : min(context, start + piece)], decode_state=state))
    mem = cache_bytes(state)
    times = []
    for i in range(context, context + steps):
        t0 = time.perf_counter()
        model.logits(model.hidden_states(tok[:, i : i + 1], decode_state=state))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], mem


def main(argv=None):
    from bench_kinds_cpu import build, kinds_of_registry

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="")
    ap.add_argument("--extra", default="approx@model.attention.options.feature_dim=16")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--piece", type=int, default=4096)
    ap.add_argument("--max-map-gb", type=float, default=1.5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    contexts = [int(x) for x in args.contexts.split(",")]
    args.seqs = [max(contexts) + args.steps]
    kinds = args.kinds.split(",") if args.kinds else [k for k in kinds_of_registry() if k != "mlp"] + ["mlp"]
    variants = [(k, k, []) for k in kinds]
    for item in filter(None, args.extra.split(";")):
        kind, _, over = item.partition("@")
        variants.append((f"{kind} ({over.split('.')[-1]})", kind, over.split(",")))
    process_groups.init_distributed(1)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = {}
    for name, kind, over in variants:
        model = build(kind, over, args)
        shares_map = getattr(model, "fixed_qk", None) is not None
        rows[name] = {}
        for c in contexts:
            if shares_map and args.piece * c * args.heads * 4 > args.max_map_gb * 2**30:
                rows[name][c] = None
                continue
            rows[name][c] = decode(model, c, args.steps, args.piece)
            print(
                f"  {name} @{c}: {1 / rows[name][c][0]:.1f} tok/s, {rows[name][c][1] / 2**20:.2f} MB",
                file=sys.stderr,
                flush=True,
            )
        del model
    head = (
        "| kind | "
        + " | ".join(f"tok/s @{c}" for c in contexts)
        + " | "
        + " | ".join(f"cache MB @{c}" for c in contexts)
        + " |"
    )
    lines = [head, "| --- |" + " ---: |" * (2 * len(contexts))]
    for name, r in rows.items():
        speed = [f"{1 / r[c][0]:.1f}" if r[c] else "n/a" for c in contexts]
        mem = [f"{r[c][1] / 2**20:.3f}" if r[c] else "n/a" for c in contexts]
        lines.append(f"| {name} | " + " | ".join(speed + mem) + " |")
    text = "\n".join(lines)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(text)
    if args.out:
        cmd = "PYTHONPATH=. python benchmarks/bench_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
        body = (
            f"`{cmd}`\n\nhidden {args.hidden}, {args.layers} layers, {args.heads} heads, batch 1, fp32, one "
            f"sequence; context prefilled in pieces of {args.piece}; median of {args.steps} token steps; "
            f"{torch.get_num_threads()} torch threads. n/a: the prefill's shared map would exceed "
            f"{args.max_map_gb} GB.\nLoad: before `{load}`; after `{after}`.\n\n{text}\n"
        )
        from megahash.atomic_write import write_text_atomic

        write_text_atomic(args.out, body)
    process_groups.teardown()


if __name__ == "__main__":
    main()
