#!/usr/bin/env python
"""CPU proxies of the GPU training step: ATen calls per step and activation bytes per token, megahash's
real trainer step against the transformers loop of the same shape.

    python benchmarks/bench_step_proxy.py [--layers 2,4] [--dtype bf16] [--seq 2048] [--batch 1]
                                          [--sides megahash,transformers] [--out FILE.md] [key=value ...]
    python benchmarks/bench_step_proxy.py --recompute none,selective,full [...]   # megahash side only
    python benchmarks/bench_step_proxy.py --forward-only --batch 8 [...]          # saved bytes only

On a GPU most of the step's time goes to kernel launches and memory traffic of small element-wise
kernels (benchmarks/results/ and the H100 profile of issue 25: ``mul``, ``copy_``, ``cat``, ``add``,
``silu`` about 45% of CUDA time). Both are visible without a GPU:

- **launch count**: every ATen call of one training step, counted by a ``TorchDispatchMode`` (below
  autograd, so the backward's calls are counted too), split into forward, backward and optimizer.
  Calls per layer = (count at the larger layer count - count at the smaller) / layer difference.
  On CUDA nearly every ATen call is one kernel launch (views and metadata ops are counted too, so
  the figures are an upper bound on launches for both sides alike).
- **activation memory**: bytes the forward saves for backward
  (``torch.autograd.graph.saved_tensors_hooks``), distinct storages, parameters excluded, per token;
  low-precision copies of weights (autocast's bf16 casts of fp32 parameters, tensors of a weight's
  shape) are a per-step cost, not a per-token one, and are reported apart in MiB per step.

megahash side: ``megahash.training.profiling.TrainHarness`` (the DeepSpeed engine ``pretrain.py``
builds, ZeRO-1, one CPU rank): forward = ``trainer.batch_loss``, backward = ``engine.backward``,
optimizer = ``engine.step`` (clipping, the optimizer, zeroing gradients). transformers side:
``Qwen2ForCausalLM`` of the same shape (SDPA, tied head, the padded vocabulary), ``model(input_ids,
labels=...)`` (what ``../shared/gpu/hf_baseline.py`` measured on the H100), ``loss.backward()``, then
``clip_grad_norm_`` + torch AdamW (``accelerator.policy.adamw_options()``) + the LR scheduler + ``zero_grad``.
Same dtype on both sides (``--dtype``, default bf16 as on GPUs). Each (side, layers) runs in its own
worker process. The step counted is the second one (the first builds optimizer state).

``--recompute none,selective,full`` runs the megahash side once per ``train.recompute`` option (one
worker each, the same run) and adds a table of what each costs against ``none`` at the same layer
count: bytes saved for backward per token, forward + backward ATen calls and CPU time
(``time.process_time`` of the worker, steadier than wall time on a shared machine).
``--forward-only`` measures the saved bytes of one forward and nothing else (no warm-up step, no
backward): a large micro-batch's activation memory without the cost of its step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = dict(hidden=896, heads=14, ffn=4864, vocab=50304)  # configs/model/500m.yaml
PHASES = ("forward", "backward", "optimizer")
# ops that are views/metadata on every backend (no kernel): reported apart from the rest
VIEW_OPS = {
    "view",
    "_unsafe_view",
    "t",
    "transpose",
    "permute",
    "expand",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "detach",
    "reshape",
    "_reshape_alias",
    "narrow",
    "unflatten",
    "flatten",
    "view_as",
    "expand_as",
    "lift_fresh",
    "_to_copy_noop",
    "is_same_size",
    "empty_like_noop",
}


def counting_mode():
    """A ``TorchDispatchMode`` counting ATen calls by name into ``mode.calls``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    return Count()


class SavedBytes:
    """Bytes saved for backward inside the context: distinct storages, those of ``exclude`` left out."""

    def __init__(self, exclude_ptrs: set[int], param_shapes: set = frozenset()):
        self.exclude = exclude_ptrs
        self.param_shapes = param_shapes
        self.storages: dict[int, int] = {}
        self.copies: dict[int, int] = {}  # low-precision copies of parameters (autocast), per step not per token
        self.by_dtype = Counter()

    def pack(self, t):
        try:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr in self.exclude or ptr in self.storages or ptr in self.copies:
            return t
        if tuple(t.shape) in self.param_shapes or tuple(t.shape[::-1]) in self.param_shapes:
            self.copies[ptr] = n
            return t
        self.storages[ptr] = n
        self.by_dtype[str(t.dtype).replace("torch.", "")] += n
        return t

    def __enter__(self):
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def param_ptrs(module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def megahash_cfg(args, layers: int, prefix: str, tokenizer: str, cache: str):
    from megahash.config import load_config

    over = [
        f"model.hidden_size={SHAPE['hidden']}",
        f"model.num_layers={layers}",
        f"model.num_heads={SHAPE['heads']}",
        f"model.ffn_hidden_size={SHAPE['ffn']}",
        f"model.vocab_size={SHAPE['vocab']}",
        f"model.max_position_embeddings={max(2048, args.seq)}",
        f"data.seq_length={args.seq}",
        f"data.prefix=[{prefix}]",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={cache}",
        f"train.micro_batch_size={args.batch}",
        f"train.global_batch_size={args.batch}",
        f"train.precision={args.dtype}",
        "train.zero_stage=1",
        "train.warmup_steps=2",
        *args.overrides,
    ]
    return load_config(None, over)


def megahash_side(args, layers: int):
    """(model, vocab, phase callables) of the real trainer step."""
    from megahash.accelerator import process_groups
    from megahash.training.profiling import TrainHarness
    from megahash.training.trainer import batch_loss

    cfg = megahash_cfg(args, layers, args.prefix, args.tokenizer, str(Path(args.work) / "cache"))
    process_groups.init_distributed(1)
    h = TrainHarness(cfg, 4)
    state = {}

    def forward():
        h.objective.set_step(h.step_no, h.dp_rank)
        state["loss"] = batch_loss(h.engine, next(h.batches), h.objective)

    def backward():
        h.engine.backward(state.pop("loss"))

    def optimizer():
        h.engine.step()
        h.step_no += 1

    info = dict(
        params=h.num_params,
        vocab=h.model.vocab_size,
        optimizer=type(h.engine.optimizer).__name__,
        inner=type(getattr(h.engine.optimizer, "optimizer", h.engine.optimizer)).__name__,
        schedule=cfg.model.schedule,
        compile=bool(cfg.train.compile),
    )
    return h.model, info, (forward, backward, optimizer)


def transformers_side(args, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megahash.accelerator import policy

    dtype = policy.train_dtype(args.dtype)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=layers,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["heads"],
        max_position_embeddings=max(2048, args.seq),
        tie_word_embeddings=True,
        use_cache=False,
        attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dev = policy.device()
    model = Qwen2ForCausalLM(cfg).to(dev, dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, **policy.adamw_options())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(5, 4000, (args.batch, args.seq), generator=g).to(dev)
    state = {}

    def forward():
        state["loss"] = model(input_ids=x, labels=x).loss

    def backward():
        state.pop("loss").backward()

    def optimizer():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    info = dict(
        params=sum(p.numel() for p in model.parameters()),
        vocab=vocab,
        optimizer=type(opt).__name__,
        inner=json.dumps(policy.adamw_options()),
        schedule="qwen2",
        compile=False,
    )
    return model, info, (forward, backward, optimizer)


def worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "megahash":
        model, info, phases = megahash_side(args, args.worker_layers)
    else:
        model, info, phases = transformers_side(args, args.worker_layers, args.vocab)
    if args.forward_only:
        phases = phases[:1]
    else:
        for fn in phases:  # warm-up step (optimizer state, lazy initialisation)
            fn()
    exclude = param_ptrs(model)
    rec = dict(info, layers=args.worker_layers, calls={}, top={}, seconds={}, cpu_seconds={})
    saved = SavedBytes(exclude, {tuple(p.shape) for p in model.parameters() if p.dim() == 2})
    for name, fn in zip(PHASES, phases):
        mode = counting_mode()
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "forward":
            with saved, mode:
                fn()
        else:
            with mode:
                fn()
        rec["seconds"][name] = time.perf_counter() - t0
        rec["cpu_seconds"][name] = time.process_time() - c0
        rec["calls"][name] = sum(mode.calls.values())
        rec["calls"][name + "_nonview"] = sum(v for k, v in mode.calls.items() if k not in VIEW_OPS)
        rec["top"][name] = mode.calls.most_common(12)
    tokens = args.batch * args.seq
    rec["saved_bytes_per_token"] = saved.total / tokens
    rec["saved_param_copies_mib"] = sum(saved.copies.values()) / 2**20
    rec["saved_by_dtype_per_token"] = {k: v / tokens for k, v in saved.by_dtype.items()}
    rec["saved_largest_mib"] = sorted((n / 2**20 for n in saved.storages.values()), reverse=True)[:6]
    if args.worker == "megahash":
        from megahash.accelerator import process_groups

        process_groups.teardown()
    return rec


def run_worker(side: str, layers: int, args, vocab: int, extra: tuple = ()) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--worker-layers",
        str(layers),
        "--vocab",
        str(vocab),
        "--dtype",
        args.dtype,
        "--seq",
        str(args.seq),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        "--work",
        args.work,
        "--prefix",
        args.prefix,
        "--tokenizer",
        args.tokenizer,
        *(["--forward-only"] if args.forward_only else []),
        *args.overrides,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("@proxy "):
            return json.loads(line[len("@proxy ") :])
    sys.stderr.write(r.stdout[-3000:] + r.stderr[-6000:])
    raise SystemExit(f"the {side} worker ({layers} layers) exited with status {r.returncode}")


def per_layer(rows: dict, side: str, key) -> float:
    (la, a), (lb, b) = sorted(rows[side].items())[0], sorted(rows[side].items())[-1]
    return (key(b) - key(a)) / (lb - la) if lb != la else float("nan")


def title(args) -> str:
    import torch
    import transformers

    return (
        f"# bench_step_proxy: h{SHAPE['hidden']} {SHAPE['heads']} heads ffn {SHAPE['ffn']} vocab {SHAPE['vocab']}, "
        f"seq {args.seq}, micro-batch {args.batch}, {args.dtype}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; overrides: {' '.join(args.overrides) or 'none'}"
    )


def fwd_bwd(r: dict, key: str = "calls", suffix: str = "") -> float:
    return r[key]["forward" + suffix] + r[key]["backward" + suffix]


def recompute_report(rows: dict, args) -> str:
    """What each ``train.recompute`` option (``rows``: option -> layers -> worker record) costs
    against ``none`` at the same layer count."""
    base = rows.get("none") or next(iter(rows.values()))
    out = [
        title(args) + "; megahash side, one worker per (train.recompute, layers)",
        "",
        "| train.recompute | layers | saved B/token | vs none | fwd+bwd calls | vs none | fwd+bwd non-view | "
        "fwd+bwd CPU s | vs none | fwd CPU s | bwd CPU s |",
        "|" + " --- |" * 11,
    ]
    for opt, by_layers in rows.items():
        for L, r in sorted(by_layers.items()):
            b = base[L]
            out.append(
                f"| {opt} | {L} | {r['saved_bytes_per_token']:,.0f} | "
                f"{r['saved_bytes_per_token'] / b['saved_bytes_per_token']:.2f}x | {fwd_bwd(r):.0f} | "
                f"{fwd_bwd(r) / fwd_bwd(b):.2f}x | {fwd_bwd(r, suffix='_nonview'):.0f} | "
                f"{fwd_bwd(r, 'cpu_seconds'):.1f} | {fwd_bwd(r, 'cpu_seconds') / fwd_bwd(b, 'cpu_seconds'):.2f}x | "
                f"{r['cpu_seconds']['forward']:.1f} | {r['cpu_seconds']['backward']:.1f} |"
            )
    per_layer_rows = [opt for opt in rows if len(rows[opt]) > 1]  # a per-layer slope needs two layer counts
    if per_layer_rows:
        out += [
            "",
            "| train.recompute | saved B/token/layer | fwd+bwd calls/layer | fwd+bwd CPU s/layer |",
            "| --- | --- | --- | --- |",
        ]
    for opt in per_layer_rows:
        m = per_layer(rows, opt, lambda r: r["saved_bytes_per_token"])
        c = per_layer(rows, opt, fwd_bwd)
        t = per_layer(rows, opt, lambda r: fwd_bwd(r, "cpu_seconds"))
        out.append(f"| {opt} | {m:,.0f} | {c:.1f} | {t:.1f} |")
    out += ["", "Largest saved storages (MiB), largest layer count:"]
    for opt, by_layers in rows.items():
        out.append(f"- {opt}: " + ", ".join(f"{x:.1f}" for x in by_layers[max(by_layers)]["saved_largest_mib"]))
    return "\n".join(out)


def memory_report(rows: dict, args) -> str:
    """Bytes one forward saves for backward, per side and layer count (``--forward-only``)."""
    out = [
        title(args) + "; one forward, no step",
        "",
        "| side | layers | saved B/token | saved by dtype (B/token) | saved weight copies (MiB/step) | "
        "largest saved storages (MiB) |",
        "|" + " --- |" * 6,
    ]
    for s, by_layers in rows.items():
        for L, r in sorted(by_layers.items()):
            dt = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["saved_by_dtype_per_token"].items()))
            big = ", ".join(f"{x:.0f}" for x in r["saved_largest_mib"][:4])
            out.append(
                f"| {s} | {L} | {r['saved_bytes_per_token']:,.0f} | {dt} | "
                f"{r.get('saved_param_copies_mib', 0):.1f} | {big} |"
            )
    out += ["", "| side | saved B/token/layer |", "| --- | --- |"]
    for s in rows:
        out.append(f"| {s} | {per_layer(rows, s, lambda r: r['saved_bytes_per_token']):,.0f} |")
    if "megahash" in rows and "transformers" in rows:
        L = max(set(rows["megahash"]) & set(rows["transformers"]))
        a, b = rows["megahash"][L]["saved_bytes_per_token"], rows["transformers"][L]["saved_bytes_per_token"]
        out += [
            "",
            f"At {L} layers (logits included): megahash {a:,.0f} B/token vs transformers {b:,.0f} "
            f"({a / b:.2f}x) -> {'MET' if a <= b else 'NOT MET'} (issue 25 item 4: no more than transformers')",
        ]
    return "\n".join(out)


def report(rows: dict, args) -> str:
    sides = list(rows)
    out = [title(args), ""]
    out.append(
        "| side | layers | params | optimizer | fwd calls | bwd calls | opt calls | fwd+bwd non-view | "
        "saved B/token | saved by dtype (B/token) | saved weight copies (MiB/step) | fwd s | bwd s | opt s |"
    )
    out.append("|" + " --- |" * 14)
    for s in sides:
        for L, r in sorted(rows[s].items()):
            c = r["calls"]
            dt = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["saved_by_dtype_per_token"].items()))
            out.append(
                f"| {s} | {L} | {r['params'] / 1e6:.1f}M | {r['optimizer']} ({r['inner']}) | {c['forward']} | "
                f"{c['backward']} | {c['optimizer']} | {c['forward_nonview'] + c['backward_nonview']} | "
                f"{r['saved_bytes_per_token']:,.0f} | {dt} | {r.get('saved_param_copies_mib', 0):.1f} | "
                f"{r['seconds']['forward']:.2f} | "
                f"{r['seconds']['backward']:.2f} | {r['seconds']['optimizer']:.2f} |"
            )
    out += [
        "",
        "| side | fwd calls/layer | bwd calls/layer | fwd+bwd calls/layer | fwd+bwd non-view/layer | "
        "opt calls/layer | saved B/token/layer |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in sides:
        f = per_layer(rows, s, lambda r: r["calls"]["forward"])
        b = per_layer(rows, s, lambda r: r["calls"]["backward"])
        nv = per_layer(rows, s, lambda r: r["calls"]["forward_nonview"] + r["calls"]["backward_nonview"])
        o = per_layer(rows, s, lambda r: r["calls"]["optimizer"])
        m = per_layer(rows, s, lambda r: r["saved_bytes_per_token"])
        out.append(f"| {s} | {f:.1f} | {b:.1f} | {f + b:.1f} | {nv:.1f} | {o:.1f} | {m:,.0f} |")
    if "megahash" in rows and "transformers" in rows:
        Lmax = max(rows["megahash"])
        mh, hf = rows["megahash"][Lmax], rows["transformers"].get(Lmax)
        fb = lambda s: per_layer(rows, s, lambda r: r["calls"]["forward"] + r["calls"]["backward"])  # noqa: E731
        opt_growth = per_layer(rows, "megahash", lambda r: r["calls"]["optimizer"])
        out += [
            "",
            "Targets (issue 25, 'Without a GPU'):",
            f"- optimizer calls grow with layers: {opt_growth:+.1f} per layer (target 0) -> "
            f"{'MET' if opt_growth <= 0 else 'NOT MET'}",
            f"- fwd+bwd calls per layer: megahash {fb('megahash'):.1f} vs transformers {fb('transformers'):.1f} -> "
            f"{'MET' if fb('megahash') <= fb('transformers') else 'NOT MET'}",
        ]
        if hf is not None:
            a, b = mh["saved_bytes_per_token"], hf["saved_bytes_per_token"]
            out.append(
                f"- saved bytes per token at {Lmax} layers (logits included): megahash {a:,.0f} vs transformers "
                f"{b:,.0f} ({a / b:.2f}x) -> {'MET' if a <= b else 'NOT MET'}"
            )
    out += ["", "Top ATen calls per phase (largest layer count):"]
    for s in sides:
        r = rows[s][max(rows[s])]
        for ph in PHASES:
            out.append(f"- {s} {ph}: " + ", ".join(f"{k} {v}" for k, v in r["top"][ph]))
        out.append(f"- {s} largest saved storages (MiB): " + ", ".join(f"{x:.1f}" for x in r["saved_largest_mib"]))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sides", default="megahash,transformers")
    ap.add_argument("--recompute", default="", help="train.recompute options to compare, e.g. none,selective,full")
    ap.add_argument("--forward-only", action="store_true", help="saved bytes of one forward only")
    ap.add_argument("--out", default="", help="also write the report here (a temp name, then renamed)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "megahash_bench_vs_hf"))
    ap.add_argument("--prefix", default="")
    ap.add_argument("--tokenizer", default="")
    ap.add_argument("--worker", choices=("megahash", "transformers"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-layers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="megahash config overrides (key=value), e.g. model.schedule=...")
    args = ap.parse_args(argv)
    if args.worker:
        print("@proxy " + json.dumps(worker(args)), flush=True)
        return 0
    if not args.prefix:
        from bench_vs_transformers import build_shards

        args.prefix, args.tokenizer = build_shards(Path(args.work))
    layers = [int(x) for x in args.layers.split(",")]
    rows: dict[str, dict[int, dict]] = {}
    vocab = 0
    # (row name, side, extra overrides): one per side, or one per recompute option (megahash only)
    runs = (
        [(f"{o}", "megahash", (f"train.recompute={o}",)) for o in args.recompute.split(",")]
        if args.recompute
        else [(s, s, ()) for s in args.sides.split(",")]
    )
    for name, side, extra in runs:
        for L in layers:
            r = run_worker(side, L, args, vocab or SHAPE["vocab"], extra)
            if side == "megahash":
                vocab = r["vocab"]
            rows.setdefault(name, {})[L] = r
            print(
                f"{name} {L} layers: calls {r['calls']}, cpu s {r['cpu_seconds']}, "
                f"saved {r['saved_bytes_per_token']:,.0f} B/token",
                flush=True,
            )
    make = recompute_report if args.recompute else memory_report if args.forward_only else report
    text = make(rows, args) + f"\n\nLoad: {os.getloadavg()[0]:.2f} (1-min average at the end)\n"
    print(text)
    if args.out:
        from megahash.atomic_write import write_text_atomic

        write_text_atomic(
            args.out,
            f"Command: python benchmarks/bench_step_proxy.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}\n\n" + text,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
