"""Analytic costs of the attention kinds, from the thesis's tables (pure python, no torch).

- :func:`attention_param_count` — Table 3.4: parameters of one attention sublayer's Q/K/V part
  (d = head dimension, n = heads, d_m = nd, output projection and biases excluded).
- :func:`memory_usage` — Table 3.13's memory model per attention block (weights, gradients, Adam
  states, activations; mixed-precision bytes) and :func:`memory_saving_ratio` against MHA.
- :func:`time_complexity` (Table 4.5), :func:`flops` / :func:`flops_per_token` (Table 4.6, GEMMs of
  one attention sublayer per iteration with the cache enabled; prefill and decode),
  :func:`activation_memory` (Table 4.7, 16-bit training with sequence parallelism over t ranks),
  :func:`cache_bytes` (Table 4.8, 16-bit inference cache per layer). B = batch, L = sequence /
  context length, d = hidden size (d = h * d_h), h = heads, t = tensor-parallel size.
  Kinds of chapter 4 use the thesis's formulas verbatim ("mha" is the "Standard" row); the
  chapter-3 kinds (sha, mqa, gqa, skv, el-att, mhe-*) get the Standard row generalised by their
  projection sizes (marked as such below; not in the thesis).
- :func:`cache_elements` — the decode cache THIS implementation keeps per layer (numbers, all TP
  ranks together), which tests compare with the modules' real caches. For ``approx`` it differs
  from Table 4.8: the thesis's cache (6Bd + 4Bd^2/h bytes) is the state of Appendix I's
  separately normalised element-wise form (eq. 4.14-4.17), megahash implements Based's
  shared-denominator feature map (state (1 + d_h + d_h^2) x (d_h + 1) per key/value head).
- :func:`layer_costs` — everything above for one layer of a megahash config, and beside it (keys
  ``impl_*``) the costs of megahash's implementation of the kind, measured on the meta device
  (:mod:`megahash.models.measured_costs`: GEMM FLOPs, decode cache, saved activations). Where the
  thesis's table and the implementation differ both are shown, labelled (``megahash params``,
  ``megahash report``); MFU uses the implemented FLOPs. A kind without a table row or that cannot
  be measured gets "n/a", never an error.
"""
from __future__ import annotations

CH3_KINDS = ("sha", "mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul")
CH4_KINDS = ("mha", "mlp", "approx", "nonapprox", "rndembqk", "fixedseqqk", "staticembqk")
THESIS_NAMES = {
    "mha": "Standard", "mlp": "MLP", "approx": "Approx.", "nonapprox": "Non-apx.", "rndembqk": "RndEmbQK",
    "fixedseqqk": "FixedSeqQK", "staticembqk": "StaticEmbQK", "sha": "SHA", "el-att": "EL-ATT", "mqa": "MQA",
    "skv": "SKV", "mhe-add": "MHE-ADD", "mhe-mul": "MHE-MUL", "gqa": "GQA",
}
# kinds whose Q/K/V projections have the standard size (parameter-matched in chapter 4)
_STANDARD_SIZED = ("mha", "approx", "nonapprox", "rndembqk", "fixedseqqk", "staticembqk")


# ----------------------------------------------------------------------------- Table 3.4


def attention_param_count(kind: str, n: int, d: int, groups: int | None = None) -> int:
    """Table 3.4: Q/K/V parameters of one attention sublayer (d = head dim, n = heads, d_m = nd).

    SHA 3d^2n, MHA 3d^2n^2, EL-ATT d^2n^2, MQA d^2n^2 + 2d^2n, SKV 2d^2n^2, MHE 3d^2n + 3dn.
    ``gqa`` (not in Table 3.4): d^2n^2 + 2d^2n*g; chapter-4 kinds with standard Q/K/V sizes count
    as MHA (``groups`` g makes them GQA-sized)."""
    kind = _kind(kind)
    if kind in ("gqa",) or (kind in _STANDARD_SIZED and groups not in (None, n)):
        g = groups if groups is not None else n
        return d * d * n * n + 2 * d * d * n * g
    table = {
        "sha": 3 * d * d * n,
        "mha": 3 * d * d * n * n,
        "el-att": d * d * n * n,
        "mqa": d * d * n * n + 2 * d * d * n,
        "skv": 2 * d * d * n * n,
        "mhe-add": 3 * d * d * n + 3 * d * n,
        "mhe-mul": 3 * d * d * n + 3 * d * n,
    }
    if kind in _STANDARD_SIZED:
        return table["mha"]
    if kind not in table:
        raise KeyError(f"no Table 3.4 parameter formula for attention kind {kind!r}")
    return table[kind]


def extra_params_over_sha(kind: str, n: int, d: int) -> int:
    """Table 3.4's last column: parameters beyond single-head attention."""
    return attention_param_count(kind, n, d) - attention_param_count("sha", n, d)


def block_params(kind: str, n: int, d: int) -> int:
    """Q/K/V parameters plus the d_m x d_m output projection (the per-block counts behind Tables
    3.1-3.3 and 3.13, e.g. 28.32M for 12 BERT-base MHA blocks)."""
    return attention_param_count(kind, n, d) + (n * d) ** 2


# ----------------------------------------------------------------------------- Table 3.13


def memory_usage(kind: str, n: int = 12, d: int = 64, batch: int = 32, seq: int = 512) -> dict:
    """Table 3.13's memory model of one attention block in fp16 mixed-precision training (bytes):
    weights = #params*(2+4), gradients = #params*(2+4), Adam states = #params*(4+4),
    activations = batch*seq*hidden*2 (hidden = n*d). Defaults: BERT-base, batch 32, sequence 512."""
    p = block_params(kind, n, d)
    out = {
        "params": p,
        "weights": p * (2 + 4),
        "gradients": p * (2 + 4),
        "adam": p * (4 + 4),
        "activations": batch * seq * n * d * 2,
    }
    out["total"] = out["weights"] + out["gradients"] + out["adam"] + out["activations"]
    return out


def memory_saving_ratio(kind: str, n: int = 12, d: int = 64, batch: int = 32, seq: int = 512) -> float:
    """Table 3.13's last column: 100 * (1 - total(kind) / total(MHA))."""
    return 100.0 * (1 - memory_usage(kind, n, d, batch, seq)["total"] / memory_usage("mha", n, d, batch, seq)["total"])


# ----------------------------------------------------------------------------- Tables 4.5-4.8


def _kind(kind: str) -> str:
    """Table row of a kind: "standard" -> mha; a kind may name its row (``thesis_row`` of its
    registered costs, e.g. approx-thesis -> the Approx. row)."""
    k = kind.lower()
    k = {"standard": "mha"}.get(k, k)
    if k in THESIS_NAMES:
        return k
    own = _registered(k)
    return getattr(own, "thesis_row", k) if own is not None else k


def _proj_params(kind: str, d: int, h: int, groups: int | None = None) -> int:
    """Q/K/V projection parameters for the generalised (chapter-3) rows, d_m = d."""
    return attention_param_count(kind, h, d // h, groups)


def _attn_width(kind: str, d: int, h: int) -> int:
    return d // h if kind == "sha" else d


def time_complexity(kind: str, B: int, L: int, d: int) -> int:
    """Table 4.5: leading terms of one forward pass without caching (O(.) value)."""
    k = _kind(kind)
    if k in ("mlp", "approx", "nonapprox"):
        return B * L * d * d
    return B * L * L * d + B * L * d * d


def flops(kind: str, phase: str, B: int, L: int, d: int, h: int | None = None, precomputed: bool = False,
          groups: int | None = None) -> int:
    """Table 4.6: GEMM FLOPs per iteration of one attention sublayer with the cache enabled.

    phase ``prefill`` (B sequences of L tokens) or ``decode`` (one new token per sequence with L
    tokens of context). ``precomputed`` (RndEmbQK/FixedSeqQK, sec. 4.13): global attention scores
    cached, prefill 2L^2d + 2BLd^2, decode 2BLd + 2d^2. Chapter-3 kinds (generalised, not in
    the thesis): 2*tokens*qkv_params + 4*B*L^2*w (prefill), 2*B*qkv_params + 4*B*L*w (decode),
    w = attention width (d, or d/h for SHA); needs ``h``."""
    k = _kind(kind)
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    pre = phase == "prefill"
    if k in ("rndembqk", "fixedseqqk") and precomputed:
        return 2 * L * L * d + 2 * B * L * d * d if pre else 2 * B * L * d + 2 * d * d
    fixed = (2 * L * L * d + 2 * B * L * L * d + 6 * B * L * d * d, 2 * L * d + 2 * B * L * d + 6 * B * d * d)
    table = {
        "mha": (4 * B * L * L * d + 6 * B * L * d * d, 6 * B * d * d + 4 * B * L * d),
        "mlp": (6 * B * L * d * d, 6 * B * d * d),
        "approx": (14 * B * L * d * d, 10 * B * d * d),
        "nonapprox": (6 * B * L * d * d, 6 * B * d * d),
        "rndembqk": fixed,
        "fixedseqqk": fixed,
        "staticembqk": (4 * B * L * L * d + 6 * B * L * d * d, 6 * B * d * d + 4 * B * L * d),
    }
    if k == "mha" and groups not in (None, h):
        k = "gqa"
    if k in table:
        return table[k][0 if pre else 1]
    if h is None:
        raise ValueError(f"flops of {kind!r} (a generalised chapter-3 row) need the number of heads h")
    p, w = _proj_params(k, d, h, groups), _attn_width(k, d, h)
    return 2 * B * L * p + 4 * B * L * L * w if pre else 2 * B * p + 4 * B * L * w


def flops_per_token(kind: str, phase: str, B: int, L: int, d: int, h: int | None = None,
                    precomputed: bool = False, groups: int | None = None) -> float:
    """Table 4.6 divided by the tokens of the iteration (B*L for prefill, B for decode)."""
    tokens = B * L if phase == "prefill" else B
    return flops(kind, phase, B, L, d, h, precomputed, groups) / tokens


def activation_memory(kind: str, B: int, L: int, d: int, h: int, t: int = 1) -> float:
    """Table 4.7: activation memory (bytes, 16-bit, sequence parallel over t) of one attention
    sublayer, attention dropout ignored. Chapter-3 kinds use the Standard row with their number
    of attention maps (1 for SHA; generalised)."""
    k = _kind(kind)
    table = {
        "mha": (8 * B * L * d + 2 * B * L * L * h) / t,
        "mlp": 8 * B * L * d / t,
        "approx": 11 * B * L * d / t + 3 * B * d * d / (h * t),
        "nonapprox": (8 * B * L * d + 4 * B * L * h) / t,
        "rndembqk": (4 * B * L * d + 8 * L * d + 2 * L * L * h) / t,
        "fixedseqqk": (4 * B * L * d + 8 * L * d + 2 * L * L * h) / t,
        "staticembqk": (8 * B * L * d + 2 * B * L * L * h) / t,
    }
    if k in table:
        return table[k]
    maps = 1 if k == "sha" else h
    return (8 * B * L * d + 2 * B * L * L * maps) / t


def cache_bytes(kind: str, B: int, L: int, d: int, h: int, groups: int | None = None) -> float:
    """Table 4.8: inference cache per layer in bytes (16-bit). Chapter-3 kinds (generalised): keys
    and values of their key/value heads, 2 bytes x 2 x B x L x width."""
    k = _kind(kind)
    table = {
        "mha": 4 * B * L * d,
        "mlp": 0,
        "approx": 6 * B * d + 4 * B * d * d / h,
        "nonapprox": 2 * B * d + 4 * B * h,
        "rndembqk": 2 * (B + 1) * L * d,
        "fixedseqqk": 2 * (B + 1) * L * d,
        "staticembqk": 4 * B * L * d,
    }
    if k == "mha" and groups not in (None, h):
        k = "gqa"
    if k in table:
        return table[k]
    d_h = d // h
    width = {"sha": d_h, "mqa": d_h, "gqa": (groups or h) * d_h}.get(k, d)
    return 4 * B * L * width


def _registered(kind: str):
    """The cost formulas a kind registers in its own file (registry.COSTS), or None."""
    from megahash.models import registry

    registry._load_variants()
    return registry.COSTS.get(kind)


def taylor_feature_dim(d_h: int) -> int:
    return 1 + d_h + d_h * d_h


def cache_elements(kind: str, B: int, L: int, n: int, d_h: int, groups: int | None = None,
                   frozen: bool = True, **opts) -> int:
    """Numbers this implementation keeps in ``decode_cache`` per layer (all TP ranks together)
    after L tokens of B sequences. ``frozen`` (rndembqk/fixedseqqk): maps frozen with
    ``FixedInput.freeze`` -> values plus the shared fixed keys, (B + 1)Lgd_h, as Table 4.8;
    otherwise the fixed sequence is decoded alongside (keys L*g*d_h, values (B + 1)L*g*d_h).
    ``opts`` (e.g. ``feature_dim``) go to a kind's own registered formula."""
    g = groups if groups is not None else n
    own = _registered(kind.lower())
    if own is not None and hasattr(own, "cache_elements"):
        return own.cache_elements(B, L, n, d_h, g, **opts)
    k = _kind(kind)
    if k == "mqa":
        g = 1
    if k == "gqa" and groups is None:
        raise ValueError("cache_elements('gqa') needs groups")
    if k in ("mha", "mqa", "gqa", "staticembqk"):
        return 2 * B * L * g * d_h
    if k == "sha":
        return 2 * B * L * d_h
    if k in ("skv", "el-att", "mhe-add", "mhe-mul"):
        return 2 * B * L * n * d_h
    if k == "mlp":
        return 0
    if k == "approx":
        return B * g * taylor_feature_dim(d_h) * (d_h + 1)
    if k == "nonapprox":
        return B * n * (d_h + 2)
    if k in ("rndembqk", "fixedseqqk"):
        return (B + 1) * L * g * d_h if frozen else (B + 2) * L * g * d_h
    raise KeyError(f"unknown attention kind {kind!r}")


NA = "n/a"
NOT_MEASURED = "not measured"  # config_costs(measure=False); `megahash params --measure` measures
IMPL_KEYS = ("prefill_flops", "decode_flops", "prefill_flops_per_token", "decode_flops_per_token",
             "cache_bytes", "activation_bytes")
_IMPL_MEMO: dict = {}


def _na(fn, *args, **kw):
    """fn(...) or "n/a" for a kind the formula does not know."""
    try:
        return fn(*args, **kw)
    except (KeyError, ValueError, TypeError, ZeroDivisionError):
        return NA


def implemented_costs(cfg, kind: str, batch: int, seq: int) -> dict:
    """Costs of megahash's implementation of ``kind`` (measured; values "n/a" when not measurable):
    prefill/decode GEMM FLOPs (and per token), decode cache bytes at 16 bit, saved activation bytes
    (16-bit training), one attention sublayer, output projection excluded (as Tables 4.6-4.8)."""
    key = (cfg.to_yaml(), kind, batch, seq)
    if key in _IMPL_MEMO:
        return dict(_IMPL_MEMO[key])
    try:
        from megahash.models.measured_costs import measure_kind

        m = measure_kind(cfg, kind, batch, seq)
    except Exception:
        m = {}
    num = lambda v: isinstance(v, (int, float))  # noqa: E731
    out = {k: NA for k in IMPL_KEYS}
    for k in ("prefill_flops", "decode_flops", "activation_bytes"):
        if num(m.get(k)):
            out[k] = m[k]
    if num(out["prefill_flops"]):
        out["prefill_flops_per_token"] = out["prefill_flops"] / (batch * seq)
    if num(out["decode_flops"]):
        out["decode_flops_per_token"] = out["decode_flops"] / batch
    if num(m.get("cache_elements")):
        out["cache_bytes"] = 2 * m["cache_elements"]
    _IMPL_MEMO[key] = dict(out)
    return out


def layer_costs(cfg, kind: str, batch: int, seq: int, measure: bool = True) -> dict:
    """All table values for one layer of kind ``kind`` under a megahash config (``cfg.model``), the
    implementation's measured values (``impl_*``; ``measure=False`` skips them) and ``differs``: the
    quantities where the thesis's table and the implementation disagree (beyond 0.5%)."""
    m = cfg.model
    n, d = m.num_heads, m.hidden_size
    d_h = d // n
    g = m.num_query_groups or n
    t = cfg.parallel.tensor
    out = {
        "kind": kind,
        "thesis_name": THESIS_NAMES.get(_kind(kind), kind) if _kind(kind) in THESIS_NAMES else NA,
        "time_complexity": _na(time_complexity, kind, batch, seq, d),
        "prefill_flops": _na(flops, kind, "prefill", batch, seq, d, n, groups=g),
        "decode_flops": _na(flops, kind, "decode", batch, seq, d, n, groups=g),
        "prefill_flops_per_token": _na(flops_per_token, kind, "prefill", batch, seq, d, n, groups=g),
        "decode_flops_per_token": _na(flops_per_token, kind, "decode", batch, seq, d, n, groups=g),
        "activation_bytes": _na(activation_memory, kind, batch, seq, d, n, t),
        "cache_bytes": _na(cache_bytes, kind, batch, seq, d, n, groups=g),
    }
    if measure:  # the kind's own registered formula (imports the kind files: torch, megatron-core)
        out["cache_elements_impl"] = _na(cache_elements, kind, batch, seq, n, d_h, groups=g)
    if out["thesis_name"] == NA:  # no row of the thesis's tables: the generalised values are not the thesis's
        for k in ("time_complexity", "prefill_flops", "decode_flops", "prefill_flops_per_token",
                  "decode_flops_per_token", "activation_bytes", "cache_bytes"):
            out[k] = NA if kind not in CH3_KINDS + ("gqa",) else out[k]
    try:
        out["qkv_params"] = attention_param_count(kind, n, d_h, g)
    except KeyError:
        out["qkv_params"] = None
    if measure:
        impl = implemented_costs(cfg, kind, batch, seq)
        out.update({f"impl_{k}": v for k, v in impl.items()})
        out["differs"] = [k for k in ("prefill_flops", "decode_flops", "cache_bytes", "activation_bytes")
                          if _differ(out[k], impl[k])]
    return out


def _differ(a, b) -> bool:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a != b
    return abs(a - b) > 0.005 * max(abs(a), abs(b), 1)


def train_flops_per_token(cfg, vocab_size: int, seq: int | None = None, measure: bool = True) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward) for MFU.

    Per layer and token: the attention sublayer's implemented prefill GEMMs (measured,
    :func:`implemented_costs`; the Table 4.6 row where not measurable or ``measure=False``; B = 1
    sequence of ``seq`` tokens) + the output projection 2d^2 + the MLP 2 * (3 if SwiGLU else 2) * d * ffn;
    plus the LM head 2 d V. Embedding lookups and norms are not counted (Megatron's convention).
    """
    from megahash.models.schedules import layer_kinds

    m = cfg.model
    L = seq or cfg.data.seq_length
    d, n, g = m.hidden_size, m.num_heads, m.num_query_groups or m.num_heads
    mlp_mats = 3 if m.arch == "decoder" else 2
    kinds = layer_kinds(m.schedule, m.num_layers)
    per_token = 0.0
    for kind in kinds:
        attn = implemented_costs(cfg, kind, 1, L)["prefill_flops_per_token"] if measure else NA
        if not isinstance(attn, (int, float)):  # not measurable: the thesis's table row (Standard if none)
            attn = _na(flops_per_token, kind, "prefill", 1, L, d, n, groups=g) if kind != "mlp" else 6 * d * d
            if not isinstance(attn, (int, float)):
                attn = flops_per_token("mha", "prefill", 1, L, d, n, groups=g)
        per_token += attn + 2 * d * d + 2 * mlp_mats * d * m.ffn_hidden_size
    per_token += 2 * d * vocab_size
    return 3.0 * per_token


def config_costs(cfg, batch: int = 1, measure: bool = True) -> dict:
    """Per-layer costs of a config (``megahash params`` shows them): Table 4.5-4.8 values at the
    config's sequence length, and the model's training FLOPs per token. ``measure=False`` leaves out
    the implementation's measured values (which import torch and megatron-core) and marks them so."""
    from megahash.models.schedules import layer_kinds

    seq = cfg.data.seq_length
    kinds = layer_kinds(cfg.model.schedule, cfg.model.num_layers)
    layers = [layer_costs(cfg, k, batch, seq, measure=measure) for k in kinds]
    vocab = cfg.model.vocab_size or 50304

    def total(key):
        vals = [x.get(key, NOT_MEASURED) for x in layers]
        return sum(vals) if all(isinstance(v, (int, float)) for v in vals) else vals[0] if vals else NA

    out = {"seq_length": seq, "batch": batch, "measured": measure,
           "train_flops_per_token": train_flops_per_token(cfg, vocab, seq, measure=measure)}
    for key in ("prefill_flops_per_token", "decode_flops_per_token", "cache_bytes", "activation_bytes"):
        out[key] = total(key)  # the thesis's tables
        out[f"impl_{key}"] = total(f"impl_{key}")  # this implementation
    out["layers"] = layers
    return out
