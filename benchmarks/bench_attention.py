"""Speed and memory of every attention kind, as ratios to ``mha`` measured in the same run.

For each kind a small uniform decoder (default: hidden 256, 4 heads of 64, 2 layers) is built and
1. forward + backward of one sequence (batch 1) at lengths 512 and 2048: wall time and memory
   (peak CUDA memory on a GPU; on CPU the bytes of tensors autograd saves for backward, i.e.
   activation memory, parameters excluded);
2. decoding: prefill a context of 128..2048 tokens, then time single-token steps (per step).
Each number is printed with its ratio to ``mha``. [Xue25] counterparts: Tables 4.5-4.8
(``megahash.models.costs``). Runs in about 2 minutes on one CPU core; the fastest repetition
(train) and the median step (decode) are reported, but a shared machine still adds noise.

Reading the memory column: torch's SDPA (mha family, staticembqk) keeps no L x L map for backward
(flash kernel, also on CPU); approx keeps two maps per layer (s and the kernel), rndembqk and
fixedseqqk one map shared by the batch, but they carry the fixed sequence as one more sequence,
which doubles everything else at batch 1 (1/B extra in general).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/bench_attention.py [--kinds mha,approx] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megahash.accelerator import policy, process_groups, rng
from megahash.config import load_config

KINDS = [
    "mha",
    "gqa",
    "mqa",
    "sha",
    "skv",
    "el-att",
    "mhe-add",
    "mhe-mul",
    "mlp",
    "approx",
    "nonapprox",
    "rndembqk",
    "fixedseqqk",
    "staticembqk",
]
VOCAB = 1024


def build(kind: str, args):
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    longest = max(args.seqs + args.contexts) + args.steps + 8
    cfg = load_config(
        None,
        [
            f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}",
            f"model.num_layers={args.layers}",
            f"model.ffn_hidden_size={4 * args.hidden}",
            f"model.schedule=uniform:{kind}",
            f"model.max_position_embeddings={longest}",
            f"model.attention.options.fixed_seq_length={longest}",
            f"data.seq_length={max(args.seqs)}",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, VOCAB).to(policy.device())
    if getattr(model, "fixed_qk", None) is not None and model.fixed_qk.source == "text":
        fixed_qk.set_fixed_tokens(model, [(31 * i + 7) % VOCAB for i in range(longest)])
    return model


def sync():
    if policy.has_gpu():
        torch.cuda.synchronize()


def saved_bytes_hooks(model):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), storage.nbytes())
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def train_step(model, seq: int, reps: int) -> tuple[float, float]:
    """Seconds of forward+backward (fastest of ``reps``) and memory in bytes (peak CUDA / saved activations on CPU)."""
    from megatron.core import tensor_parallel

    dev = policy.device()
    tok = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq)).to(dev)

    def step():
        logits = model.logits(model.hidden_states(tok))
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), tok.t().contiguous()).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)

    model.train()
    step()  # warm-up
    if policy.has_gpu():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):  # the fastest repetition: robust to other load on a shared machine
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    elapsed = min(times)
    if policy.has_gpu():
        mem = torch.cuda.max_memory_allocated() - base
    else:
        seen, hooks = saved_bytes_hooks(model)
        with hooks:
            logits = model.logits(model.hidden_states(tok))
        mem = sum(seen.values())
        del logits
    return elapsed, float(mem)


@torch.no_grad()
def decode_step(model, context: int, steps: int) -> float:
    """Median seconds of one single-token decoding step after a prefill of ``context`` tokens."""
    from megahash.models.megatron_model import DecodeState

    dev = policy.device()
    model.eval()
    tok = torch.randint(0, VOCAB, (1, context + steps), generator=torch.Generator().manual_seed(context)).to(dev)
    state = DecodeState(len(model.decoder.layers))
    model.logits(model.hidden_states(tok[:, :context], decode_state=state))
    model.logits(model.hidden_states(tok[:, context : context + 1], decode_state=state))  # warm-up step
    times = []
    for i in range(context + 1, context + steps):
        sync()
        t0 = time.perf_counter()
        model.logits(model.hidden_states(tok[:, i : i + 1], decode_state=state))
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]  # median step


def fmt(value: float, ref: float, unit: str) -> str:
    scale = {"ms": 1e3, "MB": 1 / 2**20}[unit]
    ratio = value / ref if ref else float("nan")
    return f"{value * scale:8.1f}{unit} x{ratio:5.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--contexts", default="128,256,512,1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="short sequences (smoke run)")
    args = ap.parse_args(argv)
    args.seqs = [int(x) for x in args.seqs.split(",")]
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        args.seqs, args.contexts, args.reps, args.steps = [64, 128], [32, 64], 1, 3
    kinds = args.kinds.split(",")
    if "mha" not in kinds:
        kinds = ["mha"] + kinds

    process_groups.init_distributed(1)
    print(
        f"device={policy.device()} hidden={args.hidden} heads={args.heads} layers={args.layers} "
        f"threads={torch.get_num_threads()} memory={'peak CUDA' if policy.has_gpu() else 'saved activations'}",
        flush=True,
    )
    rows = {}
    t_start = time.perf_counter()
    for kind in kinds:
        model = build(kind, args)
        row = {}
        for seq in args.seqs:
            row[("train", seq)] = train_step(model, seq, args.reps)
        for ctx in args.contexts:
            row[("decode", ctx)] = decode_step(model, ctx, args.steps)
        rows[kind] = row
        print(f"  {kind} done ({time.perf_counter() - t_start:.0f}s)", file=sys.stderr, flush=True)
        del model

    ref = rows["mha"]
    header = (
        ["kind"]
        + [f"fwd+bwd@{s}" for s in args.seqs]
        + [f"mem@{s}" for s in args.seqs]
        + [f"decode@{c}" for c in args.contexts]
    )
    widths = [12] + [17] * (len(header) - 1)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for kind, row in rows.items():
        cells = [kind]
        cells += [fmt(row[("train", s)][0], ref[("train", s)][0], "ms") for s in args.seqs]
        cells += [fmt(row[("train", s)][1], ref[("train", s)][1], "MB") for s in args.seqs]
        cells += [fmt(row[("decode", c)], ref[("decode", c)], "ms") for c in args.contexts]
        print("  ".join(cell.ljust(w) for cell, w in zip(cells, widths)))
    print(f"total {time.perf_counter() - t_start:.0f}s")
    process_groups.teardown()


if __name__ == "__main__":
    main()
