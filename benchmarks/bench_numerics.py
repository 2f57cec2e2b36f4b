"""Whole-model error of every attention kind under bf16 autocast against the same weights in fp64 (issue 33).

For each registered attention kind a uniform decoder (default: hidden 128, 2 layers, 4 heads, batch 1)
is built in fp32, copied to fp64 (the same weights), and one sequence of L random tokens runs forward
and backward (next-token cross-entropy) in both: the fp32 model under ``torch.autocast('cpu',
dtype=torch.bfloat16)`` (the dtype decisions CUDA autocast makes for matmuls; pass ``--fp32`` for
plain fp32 instead) and the fp64 model without. Reported per kind: the logits' relative error
||logits - logits64|| / ||logits64||, the relative error of all parameter gradients together and of
the worst single parameter's gradient, and whether anything was non-finite; "x mha" is the logits
error over mha's in the same run.

Weights (``--weights``): ``init`` (model.init_std 0.02) or ``trained`` (weights perturbed to the
scales trained LMs reach, :func:`trained_like`). ``--checkpoints DIR,DIR`` measures trained megahash
checkpoints instead (their own config; ``--tokens PREFIX``: the last L tokens of a shard set, e.g.
held-out text, else random tokens).

    PYTHONPATH=. python benchmarks/bench_numerics.py [--kinds mha,approx] [--seqs 2048,8192] \
        [--weights init,trained] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from megahash.accelerator import process_groups, rng
from megahash.config import load_config

VOCAB = 1024


def kinds_of_registry() -> list[str]:
    from megahash import catalog

    names = list(catalog.entries("attention"))
    return ["mha"] + [k for k in names if k != "mha"]


def trained_like(model, seed: int = 1) -> None:
    """Weights at the scales a trained LM's reach: every matrix N(0, 1/fan_in) (LeCun; x2 for the
    projections that make q, k, so attention scores q.k/sqrt(d_h) have std ~4 and reach ~15 over a
    few thousand keys), the word embeddings N(0, 1/h) (tied logits of std ~1), norm gains U(0.5, 2),
    biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                std = p.shape[-1] ** -0.5  # [out, in] matrices: 1/sqrt(fan_in); embeddings [V, h]: 1/sqrt(h)
                if any(s in name for s in ("linear_q", "linear_kv", "linear_qkv", "linear_k")):
                    std *= 2
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)


def config(kind: str, seq: int, hidden: int = 128, layers: int = 2, heads: int = 4, extra=()):
    sched = kind if ":" in kind else f"uniform:{kind}"
    return load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            f"model.num_heads={heads}",
            f"model.num_layers={layers}",
            f"model.ffn_hidden_size={4 * hidden}",
            f"model.schedule={sched}",
            f"model.max_position_embeddings={seq + 8}",
            f"model.attention.options.fixed_seq_length={seq}",
            f"data.seq_length={seq}",
            *extra,
        ],
    )


def build_pair(cfg, weights: str = "init", vocab: int = VOCAB):
    """(fp32 model, fp64 model) with the same weights."""
    from megahash.models.attention import fixed_qk
    from megahash.models.megatron_model import build_model

    models = []
    for dtype in (torch.float32, torch.float64):
        rng.seed_all(0)
        m = build_model(cfg, vocab, dtype=dtype)
        if getattr(m, "fixed_qk", None) is not None and m.fixed_qk.source == "text":
            fixed_qk.set_fixed_tokens(m, [(31 * i + 7) % vocab for i in range(cfg.data.seq_length)])
        models.append(m.train())
    if weights == "trained":
        trained_like(models[0])
    models[1].load_state_dict(models[0].state_dict())
    return models


def run(model, tok, autocast: torch.dtype | None):
    """(logits [s, b, V] fp64, {name: grad fp64}) of one forward + backward."""
    from megatron.core import tensor_parallel

    model.zero_grad(set_to_none=True)
    labels = tok.roll(-1, 1).t().contiguous()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = model.logits(model.hidden_states(tok))
    out = logits.detach().double().clone()  # megatron's cross-entropy shifts fp32 logits in place
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.to(dt), labels).mean()
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def checkpoint_pair(path: str, seq: int):
    """(fp32 model, fp64 model) of a trained checkpoint, positions extended to ``seq``."""
    from megahash.checkpoint.weights import load_for_inference
    from megahash.models.megatron_model import MegahashLM

    cfg, m32, _ = load_for_inference(path, [f"model.max_position_embeddings={seq + 8}", f"data.seq_length={seq}"])
    m64 = MegahashLM(cfg, m32.output_weight().shape[0], torch.float64, init=False)
    m64.load_state_dict(m32.state_dict())
    return m32.eval(), m64.eval()


def shard_tokens(prefix: str, seq: int) -> torch.Tensor:
    """[1, seq] of the last ``seq`` tokens of a Megatron shard set (its last documents)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds, parts, n = IndexedDataset(prefix), [], 0
    for i in range(len(ds) - 1, -1, -1):
        parts.insert(0, torch.as_tensor(ds[i].astype("int64")))
        n += parts[0].numel()
        if n >= seq:
            break
    return torch.cat(parts)[-seq:].unsqueeze(0)


def compare(cfg, seq: int, weights: str = "init", autocast=torch.bfloat16, seed: int = 0, pair=None, tok=None) -> dict:
    """Relative errors of logits and gradients (module docstring) for one config and length."""
    m32, m64 = pair or build_pair(cfg, weights)
    if tok is None:
        tok = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seed))
    lo, go = run(m32, tok, autocast)
    lr, gr = run(m64, tok, None)
    finite = bool(torch.isfinite(lo).all()) and all(bool(torch.isfinite(g).all()) for g in go.values())
    names = sorted(gr)
    flat_o = torch.cat([go[n].flatten() for n in names])
    flat_r = torch.cat([gr[n].flatten() for n in names])
    worst = max((rel(go[n], gr[n]), n) for n in names if gr[n].norm() > 0)
    return {
        "logits": rel(lo, lr),
        "grads": rel(flat_o, flat_r),
        "worst": worst[0],
        "worst_name": worst[1],
        "finite": finite,
    }


def checkpoints_table(a) -> int:
    auto = None if a.fp32 else torch.bfloat16
    lines = [
        f"`python benchmarks/bench_numerics.py {' '.join(sys.argv[1:])}` (trained checkpoints, "
        f"{'fp32' if a.fp32 else 'bf16 autocast'} vs fp64, batch 1)",
        "",
    ]
    for seq in map(int, a.seqs.split(",")):
        lines += [
            f"### trained checkpoints, L={seq}",
            "",
            "| checkpoint | logits rel. err | grads rel. err | worst param grad rel. err | finite |",
            "| --- | ---: | ---: | ---: | --- |",
        ]
        for path in a.checkpoints.split(","):
            pair = checkpoint_pair(path, seq)
            tok = shard_tokens(a.tokens, seq) if a.tokens else None
            if tok is None:
                tok = torch.randint(
                    0, pair[0].output_weight().shape[0], (1, seq), generator=torch.Generator().manual_seed(0)
                )
            r = compare(None, seq, autocast=auto, pair=pair, tok=tok)
            lines.append(
                f"| {path} | {r['logits']:.2e} | {r['grads']:.2e} | {r['worst']:.2e} "
                f"({r['worst_name'].split('.', 2)[-1][:40]}) | {r['finite']} |"
            )
            print(lines[-1], flush=True)
        lines.append("")
    return _report(lines, a.out)


def _report(lines: list[str], out: str) -> int:
    """Print the table, append it to ``out`` when given, and release the one-rank world."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")
    process_groups.teardown()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", default="", help="comma-separated (default: every registered kind)")
    p.add_argument("--seqs", default="2048,8192")
    p.add_argument("--weights", default="init,trained")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--fp32", action="store_true", help="plain fp32 instead of bf16 autocast")
    p.add_argument("--extra", default="", help="kind@override,override rows added to the kinds")
    p.add_argument("--checkpoints", default="", help="comma-separated megahash checkpoints (rows) instead of kinds")
    p.add_argument("--tokens", default="", help="with --checkpoints: a shard prefix whose last L tokens are the input")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    process_groups.init_distributed(1)
    if a.checkpoints:
        return checkpoints_table(a)
    kinds = a.kinds.split(",") if a.kinds else kinds_of_registry()
    kinds += [e for e in a.extra.split(";") if e]
    auto = None if a.fp32 else torch.bfloat16
    lines = [
        f"`python benchmarks/bench_numerics.py {' '.join(argv or sys.argv[1:])}` "
        f"({'fp32' if a.fp32 else 'bf16 autocast'} vs fp64; hidden {a.hidden}, {a.layers} layers, batch 1)",
        "",
    ]
    for weights in a.weights.split(","):
        for seq in map(int, a.seqs.split(",")):
            lines += [
                f"### weights={weights}, L={seq}",
                "",
                "| kind | logits rel. err | x mha | grads rel. err | worst param grad rel. err | finite | s |",
                "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
            ]
            base = None
            for kind in kinds:
                name, _, extra = kind.partition("@")
                t0 = time.perf_counter()
                try:
                    r = compare(
                        config(name, seq, a.hidden, a.layers, extra=[e for e in extra.split(",") if e]),
                        seq,
                        weights,
                        auto,
                    )
                except Exception as e:  # a kind that cannot run is a row, not a crash
                    lines.append(f"| {kind} | error: {type(e).__name__}: {str(e)[:80]} | | | | | |")
                    print(lines[-1], flush=True)
                    continue
                base = r["logits"] if name == "mha" and not extra else base
                ratio = f"{r['logits'] / base:.2f}" if base else ""
                lines.append(
                    f"| {kind} | {r['logits']:.2e} | {ratio} | {r['grads']:.2e} | {r['worst']:.2e} "
                    f"({r['worst_name'].split('.', 2)[-1][:40]}) | {r['finite']} | {time.perf_counter() - t0:.0f} |"
                )
                print(lines[-1], flush=True)
            lines.append("")
    return _report(lines, a.out)


if __name__ == "__main__":
    sys.exit(main())
