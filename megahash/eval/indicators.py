"""Attention pattern indicators ([Xue25] sec. 4.4.4) and pre-softmax logits (Figures 4.1, 4.2).

    megahash indicators --checkpoint DIR --text FILE [--out DIR] [--max-tokens N] [--windows K]

For each layer l and head j the attention matrix A_j in R^{L x L} of a text window of L tokens is
captured (see "Capture" below) and the indicators of sec. 4.4.4 are computed exactly as defined
there (sums over all entries a of the matrix):

- Entropy (H): H = - sum_{a in A} a log a (0 log 0 = 0). High: uniform, mean-pooling-like mixing.
- Concentration (Conc): Conc = ||A||_F = sqrt(sum_{a in A} a^2). High: focus on few tokens.
- Head diversity (HeadDiv, per layer): HeadDiv = 2 / (L (1 + L)) sum std({A_1, ..., A_{n_h}}): the
  position-wise standard deviation across the layer's heads (population std, ddof 0), summed over
  the L(L+1)/2 causal positions (j <= i) and divided by their number; for bidirectional encoders
  over all L^2 positions.
- Attention sink (Sink): Sink = sum A_{:,1} / L: the mean attention of all queries to the first token.
- Local focus (LocFoc_N): LocFoc_N = sum_i A_{i, i-N} / (L - N): the mean attention at relative
  distance N (the N-th sub-diagonal), N in {0, 1, 2, 3}.

The JSON holds raw values per head, their head means per layer, and HeadDiv per layer (averaged
over ``--windows`` consecutive windows). Footnote 5 of [Xue25] plots H, Conc and HeadDiv
min-max normalised across layers and Sink/LocFoc_N as absolute values (LocFoc_N x 2): the layer
heatmap ``indicators_layers.png`` does the same. ``indicators_heads.png`` shows each indicator per
layer (x) and head (y); ``logits.png`` the distribution of the pre-softmax logits per layer
(box plot on a symmetric-log axis and the largest |logit| per layer, Figure 4.2's outlier view).

Capture (opt-in, training code untouched): :class:`AttentionCapture` attaches to every attention
module for the duration of a ``with`` block and rebuilds the (equivalent) attention matrix from the
module's own Q and K, as the module computed them for that forward:

==============================  ======================================================================
kind                            how A and the logits are obtained
==============================  ======================================================================
mha, gqa, mqa, sha, skv,        forward hook on the module's ``core_attention`` (SDPA): A = softmax(QK^T
el-att, mhe-add/mul, swa,       / sqrt(d_h) + causal mask, and the core's sliding window) from the hook's Q, K
staticembqk, mha-megatron       (after RoPE, GQA groups repeated); logits = QK^T / sqrt(d_h) on the causal positions
rndembqk, fixedseqqk            wrap of the instance's ``attend``: the one shared map
                                softmax(Q_X K_X^T / sqrt(d_h)) of the fixed input (the same for every
                                sequence); logits as above
approx                          wrap of ``attend``: A_ij = k(q_i, k_j) / sum_{u<=i} k(q_i, k_u) with the
                                Taylor kernel k = 1 + s + s^2/2, s = q.k / sqrt(d_h) (its normalised
                                equivalent attention matrix, exactly what multiplies V); logits = s
nonapprox                       wrap of ``attend``: A_ij = e^{s_j} / sum_{u<=i} e^{s_u} (j <= i),
                                s_j = q_j.k_j / sqrt(d_h) (eq. 4.7-4.8, 4.18); logits = s_j per key
mlp                             no token mixing: A = I (each output reads only its own token); no logits
skipped layers (`skip` mode)    not run: reported as skipped
==============================  ======================================================================

A module exposing ``attention_maps()`` itself is not required; kinds added later that have a
``core_attention`` submodule are captured by the hook automatically, others are reported as
"unavailable".
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from megahash.ops.utils.window import band_mask

INDICATORS = ["entropy", "conc", "sink", "locfoc_0", "locfoc_1", "locfoc_2", "locfoc_3"]
LABELS = {
    "entropy": "H",
    "conc": "Conc",
    "head_div": "HeadDiv",
    "sink": "Sink",
    "locfoc_0": "LocFoc0",
    "locfoc_1": "LocFoc1",
    "locfoc_2": "LocFoc2",
    "locfoc_3": "LocFoc3",
}


# ============================================================================ indicator formulas
def _as3d(A) -> torch.Tensor:
    A = torch.as_tensor(A, dtype=torch.float64)
    return A.unsqueeze(0) if A.dim() == 2 else A


def entropy(A) -> torch.Tensor:
    """H = - sum_{a in A} a log a per head; A [L, L] or [heads, L, L] -> [] or [heads]."""
    A3 = _as3d(A)
    h = -(torch.where(A3 > 0, A3 * torch.log(A3.clamp_min(1e-300)), torch.zeros_like(A3))).sum((-1, -2))
    return h[0] if torch.as_tensor(A).dim() == 2 else h


def concentration(A) -> torch.Tensor:
    """Conc = ||A||_F = sqrt(sum a^2) per head."""
    A3 = _as3d(A)
    c = A3.square().sum((-1, -2)).sqrt()
    return c[0] if torch.as_tensor(A).dim() == 2 else c


def sink(A) -> torch.Tensor:
    """Sink = sum A_{:,1} / L: mean attention paid to the first token."""
    A3 = _as3d(A)
    s = A3[..., :, 0].sum(-1) / A3.shape[-2]
    return s[0] if torch.as_tensor(A).dim() == 2 else s


def local_focus(A, n: int) -> torch.Tensor:
    """LocFoc_N = sum_i A_{i, i-N} / (L - N): mean attention at relative distance N."""
    A3 = _as3d(A)
    L = A3.shape[-1]
    if n >= L:
        out = torch.zeros(A3.shape[0], dtype=torch.float64)
    else:
        out = torch.diagonal(A3, offset=-n, dim1=-2, dim2=-1).sum(-1) / (L - n)
    return out[0] if torch.as_tensor(A).dim() == 2 else out


def head_diversity(A, causal: bool = True) -> float:
    """HeadDiv = 2 / (L (1 + L)) sum_{j <= i} std_heads(A[:, i, j]) (population std); for
    bidirectional maps the mean over all L^2 positions."""
    A3 = _as3d(A)
    L = A3.shape[-1]
    std = A3.std(dim=0, unbiased=False)
    if causal:
        return float(torch.tril(std).sum() * 2.0 / (L * (1 + L)))
    return float(std.mean())


def head_indicators(A) -> dict[str, list[float]]:
    """All per-head indicators of one layer's maps [heads, L, L]."""
    A3 = _as3d(A)
    out = {"entropy": entropy(A3), "conc": concentration(A3), "sink": sink(A3)}
    for n in range(4):
        out[f"locfoc_{n}"] = local_focus(A3, n)
    return {k: [float(x) for x in v] for k, v in out.items()}


# ============================================================================ capture
def _caps(kind: str):
    from megahash import catalog

    return catalog.caps("attention", kind)


def _registered_maps(kind: str):
    from megahash.models import registry

    return registry.spec("attention", kind).maps


def _softmax_maps(q, k, scale: float, causal: bool, mask=None, window=None):
    """q [sq, b, n, d], k [sk, b, g, d] -> (A [b, n, sq, sk], logits [b, n, sq, sk], valid [sq, sk]); ``window``:
    the keys of a sliding window only (megahash.ops.utils.window)."""
    qh = q.permute(1, 2, 0, 3).double()
    kh = k.permute(1, 2, 0, 3).double()
    if kh.shape[1] != qh.shape[1]:
        kh = kh.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1)
    logits = (qh @ kh.transpose(-1, -2)) * scale
    sq, sk = logits.shape[-2:]
    valid = torch.ones(sq, sk, dtype=torch.bool, device=logits.device)
    valid = valid.tril(sk - sq) if causal else valid
    if window is not None:
        valid = valid & band_mask(sq, sk, window, causal, logits.device)
    keep = valid.expand_as(logits)
    if mask is not None:  # megatron: True = masked out, [b, 1, 1|sq, sk]
        keep = keep & ~mask.bool()
    probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
    return probs, logits, valid


class AttentionCapture:
    """``with AttentionCapture(model, batch) as cap: model(tokens)`` -> ``cap.layers[i]`` =
    dict(kind, source, probs [b, heads, L, L] float64, logits (1-D tensor of the valid pre-softmax
    values) or None, causal) for every layer that ran (see the module docstring)."""

    def __init__(self, model, batch: int | None = None, verify: bool = False):
        self.model = model
        self.batch = batch
        self.verify = verify  # also store check_err = max |A V - module output| (tests)
        self.kinds = list(getattr(model, "layer_kinds", []))
        self.layers: list[dict | None] = []
        self._handles = []
        self._patched = []

    def __enter__(self):
        modules = [layer.self_attention for layer in self.model.decoder.layers]
        self.layers = [None] * len(modules)
        for i, m in enumerate(modules):
            self._attach(i, m)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        for m in self._patched:
            if "attend" in m.__dict__:
                del m.__dict__["attend"]
        self._handles, self._patched = [], []
        return False

    def _kind(self, i, m) -> str:
        return getattr(m, "kind", None) or (self.kinds[i] if i < len(self.kinds) else type(m).__name__)

    def _store(self, i, kind, source, probs, logits, valid, causal):
        b = self.batch or probs.shape[0]
        probs = probs[:b] if probs.shape[0] > 1 else probs.expand(b, *probs.shape[1:])
        vals = None
        if logits is not None:
            lg = logits[:b] if logits.shape[0] > 1 else logits
            vals = lg[..., valid].reshape(-1).float() if valid is not None else lg.reshape(-1).float()
        self.layers[i] = {
            "kind": kind,
            "source": source,
            "probs": probs.detach().cpu(),
            "logits": None if vals is None else vals.cpu(),
            "causal": causal,
        }

    def _check(self, i, err) -> None:
        if self.verify and self.layers[i] is not None:
            self.layers[i]["check_err"] = float(err)

    def _attach(self, i, m) -> None:
        kind = self._kind(i, m)
        core = getattr(m, "core_attention", None)
        if isinstance(core, torch.nn.Module):
            from megatron.core.transformer.enums import AttnMaskType

            def hook(mod, args, kwargs, output, i=i, kind=kind):
                names = ["query", "key", "value", "attention_mask"]
                got = dict(zip(names, args))
                got.update({k: v for k, v in kwargs.items() if k in names})
                q, k, mask = got["query"], got["key"], got.get("attention_mask")
                mtype = kwargs.get("attn_mask_type") or getattr(mod, "attn_mask_type", None)
                causal = mtype == AttnMaskType.causal and mask is None
                scale = getattr(mod, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
                probs, logits, valid = _softmax_maps(q, k, scale, causal, mask, kwargs.get("window"))
                self._store(i, kind, "softmax(QK^T/sqrt(d_h)) from core_attention", probs, logits, valid, causal)
                if self.verify:
                    v = got["value"].permute(1, 2, 0, 3).double()
                    v = v.repeat_interleave(probs.shape[1] // v.shape[1], dim=1)
                    av = (probs @ v).permute(2, 0, 1, 3).reshape(output.shape)
                    self._check(i, (av - output.double()).abs().max())

            self._handles.append(core.register_forward_hook(hook, with_kwargs=True))
            return
        attend = getattr(m, "attend", None)
        if not _caps(kind).mixes_tokens or (attend is None and hasattr(m, "linear_gate")):

            def ident_hook(mod, args, output, i=i, kind=kind):
                x = args[0]
                L, b = x.shape[0], self.batch or x.shape[1]
                probs = torch.eye(L, dtype=torch.float64).expand(b, 1, L, L)
                self._store(i, kind, "identity (no token mixing)", probs, None, None, True)

            self._handles.append(m.register_forward_hook(ident_hook))
            return
        if attend is None:
            self.layers[i] = {"kind": kind, "source": "unavailable", "probs": None, "logits": None, "causal": True}
            return
        original = attend
        maps = _registered_maps(kind)
        if maps is not None:  # the kind's own capture (its file registers it: register_attention(maps=...))

            def wrapped(q, k, v, attention_mask, *state, _o=original, i=i, kind=kind, m=m, maps=maps):
                r = maps(m, q, k, v, attention_mask)
                self._store(i, kind, r["source"], r["probs"], r.get("logits"), r.get("valid"), m.causal)
                if r.get("logit_values") is not None:  # logits not of the map's shape (one per key)
                    lv = r["logit_values"]
                    self.layers[i]["logits"] = lv[: self.batch or lv.shape[0]].reshape(-1).float().cpu()
                out = _o(q, k, v, attention_mask, *state)
                if self.verify:
                    self._check(i, r["check"](out))
                return out
        else:  # softmax over attend's q, k (the fixed-input kinds' SeparateQKV.attend: q [s, 1, n, d], k [sk, 1, g, d])

            def wrapped(q, k, v, attention_mask, _o=original, i=i, kind=kind, m=m):
                scale = getattr(m, "scale", 1.0 / math.sqrt(q.shape[-1]))
                probs, logits, valid = _softmax_maps(q, k, scale, m.causal)
                self._store(
                    i, kind, "shared softmax(Q_X K_X^T/sqrt(d_h)) of the fixed input", probs, logits, valid, m.causal
                )
                out = _o(q, k, v, attention_mask)
                if self.verify:  # probs [1, n, s, sk]; v [sk, b, g, d]; out [s, b, n*d]
                    vh = v.permute(1, 2, 0, 3).double()
                    vh = vh.repeat_interleave(probs.shape[1] // vh.shape[1], dim=1)
                    av = (probs @ vh).permute(2, 0, 1, 3).reshape(out.shape)
                    self._check(i, (av - out.double()).abs().max())
                return out

        m.__dict__["attend"] = wrapped
        self._patched.append(m)


# ============================================================================ driver
def layer_records(captured: list[dict | None], kinds: list[str]) -> list[dict]:
    """Per-layer JSON records (indicators of the first sequence of the batch)."""
    out = []
    for i, rec in enumerate(captured):
        kind = kinds[i] if i < len(kinds) else "?"
        if rec is None:
            out.append({"layer": i + 1, "kind": kind, "source": "skipped (layer not run)"})
            continue
        if rec["probs"] is None:
            out.append({"layer": i + 1, "kind": rec["kind"], "source": rec["source"]})
            continue
        A = rec["probs"][0]
        heads = head_indicators(A)
        out.append(
            {
                "layer": i + 1,
                "kind": rec["kind"],
                "source": rec["source"],
                "seq_len": int(A.shape[-1]),
                "heads": heads,
                "mean": {k: float(np.mean(v)) for k, v in heads.items()},
                "head_div": head_diversity(A, rec["causal"]),
            }
        )
    return out


def logit_stats(values: torch.Tensor | None) -> dict | None:
    if values is None or values.numel() == 0:
        return None
    v = values.double().numpy()
    q = np.percentile(v, [1, 5, 25, 50, 75, 95, 99])
    edges = np.linspace(v.min(), v.max() if v.max() > v.min() else v.min() + 1, 41)
    counts, _ = np.histogram(v, bins=edges)
    return {
        "count": int(v.size),
        "min": float(v.min()),
        "max": float(v.max()),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "abs_max": float(np.abs(v).max()),
        "percentiles": {p: float(x) for p, x in zip(["p01", "p05", "p25", "p50", "p75", "p95", "p99"], q)},
        "hist": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
    }


def _merge(records: list[list[dict]]) -> list[dict]:
    """Average per-window records (same layers) into one."""
    first = records[0]
    if len(records) == 1:
        return first
    out = []
    for i, rec in enumerate(first):
        if "heads" not in rec:
            out.append(rec)
            continue
        heads = {
            k: [float(np.mean([r[i]["heads"][k][j] for r in records])) for j in range(len(rec["heads"][k]))]
            for k in rec["heads"]
        }
        out.append(
            {
                **rec,
                "heads": heads,
                "mean": {k: float(np.mean(v)) for k, v in heads.items()},
                "head_div": float(np.mean([r[i]["head_div"] for r in records])),
                "windows": len(records),
            }
        )
    return out


@torch.no_grad()
def compute(model, codec, text: str, max_tokens: int, windows: int = 1) -> tuple[list[dict], dict]:
    """Indicators of ``windows`` consecutive windows of ``max_tokens`` tokens of ``text``; returns
    (layer records, info) with the pre-softmax logit statistics in each layer record."""
    from megahash.errors import DataError

    enc = codec.special(codec.eos_id) + codec.encode(text)
    if len(enc) < 4:
        raise DataError("the text gives fewer than 3 tokens; give a longer --text")
    per_window, logits = [], {}
    kinds = list(getattr(model, "layer_kinds", []))
    used = 0
    for w in range(windows):
        part = enc[w * max_tokens : (w + 1) * max_tokens]
        if len(part) < 4:
            break
        codes = codec.codes(part)
        dev = next(model.parameters()).device
        tok = torch.tensor([part.ids], dtype=torch.long, device=dev)
        cod = None
        if codes is not None:
            t = torch.from_numpy(np.ascontiguousarray(codes))[None]
            cod = (t if t.dtype == torch.uint8 else t.long()).to(dev)
        with AttentionCapture(model, batch=1) as cap:
            model(tok, hash_codes=cod)
        per_window.append(layer_records(cap.layers, kinds))
        for i, rec in enumerate(cap.layers):
            if rec is not None and rec.get("logits") is not None:
                logits.setdefault(i, []).append(rec["logits"])
        used += 1
    merged = _merge(per_window)
    for i, rec in enumerate(merged):
        rec["logits"] = logit_stats(torch.cat(logits[i])) if i in logits else None
    info = {"windows": used, "window_tokens": max_tokens, "text_tokens": len(enc) - 1}
    return merged, info


# ============================================================================ plots
def _save(fig, path: Path) -> str:
    """Lay out, write (110 dpi) and close a matplotlib figure; its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot(records: list[dict], out_dir: Path, title: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    layers = [r for r in records if "heads" in r]
    if layers:
        names = INDICATORS
        n_heads = max(len(r["heads"]["entropy"]) for r in layers)
        fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
        for ax, name in zip(axes.flat, names + ["head_div"]):
            if name == "head_div":
                grid = np.array([[r["head_div"] for r in layers]])
                ylabels = ["layer"]
            else:
                grid = np.full((n_heads, len(layers)), np.nan)
                for c, r in enumerate(layers):
                    vals = r["heads"][name]
                    grid[: len(vals), c] = vals
                ylabels = None
            im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower")
            ax.set_title(LABELS[name])
            ax.set_xticks(range(len(layers)), [str(r["layer"]) for r in layers], fontsize=7)
            ax.set_xlabel("layer")
            if ylabels:
                ax.set_yticks([0], ylabels)
            else:
                ax.set_ylabel("head")
                ax.set_yticks(range(n_heads), [str(h + 1) for h in range(n_heads)], fontsize=7)
            fig.colorbar(im, ax=ax, fraction=0.046)
        fig.suptitle(f"Attention indicators per layer and head {title}".strip())
        written.append(_save(fig, out_dir / "indicators_heads.png"))

        # layer summary (Figure 4.1's quantities; footnote 5 normalisation)
        rows = ["entropy", "conc", "head_div", "sink", "locfoc_0", "locfoc_1", "locfoc_2", "locfoc_3"]
        grid = np.zeros((len(rows), len(layers)))
        for c, r in enumerate(layers):
            for k, name in enumerate(rows):
                grid[k, c] = r["head_div"] if name == "head_div" else r["mean"][name]
        shown = grid.copy()
        for k, name in enumerate(rows):
            if name in ("entropy", "conc", "head_div"):
                lo, hi = grid[k].min(), grid[k].max()
                shown[k] = (grid[k] - lo) / (hi - lo) if hi > lo else 0.5
            elif name.startswith("locfoc"):
                shown[k] = np.clip(2 * grid[k], 0, 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(layers) + 3), 4))
        im = ax.imshow(shown, aspect="auto", cmap="magma", vmin=0, vmax=1)
        ax.set_yticks(
            range(len(rows)),
            [
                LABELS[n]
                + (" (min-max)" if n in ("entropy", "conc", "head_div") else " (x2)" if n.startswith("locfoc") else "")
                for n in rows
            ],
        )
        ax.set_xticks(range(len(layers)), [f"{r['layer']}\n{r['kind']}" for r in layers], fontsize=7)
        for k in range(len(rows)):
            for c in range(len(layers)):
                ax.text(
                    c,
                    k,
                    f"{grid[k, c]:.2g}",
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if shown[k, c] < 0.6 else "black",
                )
        fig.colorbar(im, ax=ax, fraction=0.03)
        ax.set_title(f"Layer-wise attention indicators (head means) {title}".strip())
        written.append(_save(fig, out_dir / "indicators_layers.png"))

    with_logits = [r for r in records if r.get("logits")]
    if with_logits:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 0.7 * len(with_logits) + 6), 4))
        stats = []
        for r in with_logits:
            p = r["logits"]["percentiles"]
            stats.append(
                {
                    "label": f"{r['layer']}",
                    "whislo": p["p01"],
                    "q1": p["p25"],
                    "med": p["p50"],
                    "q3": p["p75"],
                    "whishi": p["p99"],
                    "fliers": [r["logits"]["min"], r["logits"]["max"]],
                }
            )
        ax1.bxp(stats, showfliers=True)
        ax1.set_yscale("symlog", linthresh=1.0)
        ax1.set_xlabel("layer")
        ax1.set_ylabel("pre-softmax logit (whiskers p1/p99, dots min/max)")
        ax1.set_title("Distribution of pre-softmax activations")
        ax2.bar([s["label"] for s in stats], [r["logits"]["abs_max"] for r in with_logits], color="tab:red")
        ax2.set_yscale("log")
        ax2.set_ylim(bottom=min(0.1, 0.5 * min(r["logits"]["abs_max"] for r in with_logits)))
        ax2.set_xlabel("layer")
        ax2.set_ylabel("max |logit|")
        ax2.set_title("Largest activation per layer")
        fig.suptitle(title)
        written.append(_save(fig, out_dir / "logits.png"))
    return written


# ============================================================================ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megahash indicators",
        description="Attention pattern indicators ([Xue25] sec. 4.4.4, docs/references.md) of a checkpoint on a text.",
    )
    p.add_argument("--checkpoint", required=True, help="run directory or step_N directory")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/indicators)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens per window (default data.seq_length)")
    p.add_argument("--windows", type=int, default=1, help="consecutive windows to average")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--override", action="append", default=[], help="config override key=value (repeatable)")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from megahash.command_errors import run_guarded

    args = build_parser().parse_args(argv)

    def run():
        from megahash.errors import ConfigError, DataError

        if args.max_tokens < 0 or args.windows < 1:
            raise ConfigError("--max-tokens must be >= 0 and --windows >= 1")
        path = Path(args.text)
        if not path.is_file():
            raise DataError(f"--text {path} does not exist")
        text = path.read_text(encoding="utf-8", errors="replace")
        from megahash.eval.text import load_codec, load_model

        cfg, model, ckpt = load_model(args.checkpoint, args.override)
        from megahash import accelerator

        if accelerator.has_gpu():
            model = model.to(accelerator.device())
        codec = load_codec(cfg, ckpt, args.tokenizer, model_vocab=model.vocab_size)
        max_tokens = args.max_tokens or cfg.data.seq_length
        records, info = compute(model, codec, text, max_tokens, args.windows)
        out = Path(args.out) if args.out else ckpt.parent / "indicators"
        out.mkdir(parents=True, exist_ok=True)
        record = {
            "checkpoint": str(ckpt),
            "text": str(path),
            "schedule": cfg.model.schedule,
            **info,
            "definitions": "thesis sec. 4.4.4; see megahash/eval/indicators.py",
            "layers": records,
        }
        (out / "indicators.json").write_text(json.dumps(record, indent=1) + "\n")
        written = [] if args.no_plots else plot(records, out, f"({cfg.model.schedule})")
        print(format_table(records))
        print(f"\nwrote {out / 'indicators.json'}" + "".join(f", {w}" for w in written))
        return 0

    return run_guarded(run)


def format_table(records: list[dict]) -> str:
    lines = [
        "| layer | kind | H | Conc | HeadDiv | Sink | LocFoc0 | LocFoc1 | LocFoc2 | LocFoc3 | max abs logit |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        if "mean" not in r:
            lines.append(f"| {r['layer']} | {r['kind']} | {r['source']} |" + " |" * 8)
            continue
        m = r["mean"]
        lg = r.get("logits")
        mx = f"{lg['abs_max']:.3g}" if lg else ""
        lines.append(
            f"| {r['layer']} | {r['kind']} | {m['entropy']:.3f} | {m['conc']:.3f} | {r['head_div']:.4f} | "
            f"{m['sink']:.3f} | {m['locfoc_0']:.3f} | {m['locfoc_1']:.3f} | {m['locfoc_2']:.3f} | "
            f"{m['locfoc_3']:.3f} | {mx} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
