"""Analytic costs of the attention kinds, from the [Xue25] tables (pure python, no torch).

- :func:`attention_param_count` — Table 3.4: parameters of one attention sublayer's Q/K/V part
  (d = head dimension, n = heads, d_m = nd, output projection and biases excluded).
- :func:`memory_usage` — Table 3.13's memory model per attention block (weights, gradients, Adam
  states, activations; mixed-precision bytes) and :func:`memory_saving_ratio` against MHA.
- :func:`time_complexity` (Table 4.5), :func:`flops` / :func:`flops_per_token` (Table 4.6, GEMMs of
  one attention sublayer per iteration with the cache enabled; prefill and decode),
  :func:`activation_memory` (Table 4.7, 16-bit training with sequence parallelism over t ranks),
  :func:`cache_bytes` (Table 4.8, 16-bit inference cache per layer). B = batch, L = sequence /
  context length, d = hidden size (d = h * d_h), h = heads, t = tensor-parallel size.
  Every formula is the kind's own (its cost class, registered in its file; see "formula bases"
  below): chapter-4 kinds use the [Xue25] rows verbatim, chapter-3 kinds the Standard row
  generalised by their projection sizes (:class:`GeneralisedRow`; not in [Xue25]). A kind
  registered with ``costs=None`` is "measured only".
- :func:`cache_elements` — the decode cache THIS implementation keeps per layer (numbers, all TP
  ranks together), which tests compare with the modules' real caches. For ``approx`` it differs
  from Table 4.8: the [Xue25] cache (6Bd + 4Bd^2/h bytes) is the state of Appendix I's
  separately normalised element-wise form (eq. 4.14-4.17), megahash implements Based's
  shared-denominator feature map (state (1 + d_h + d_h(d_h+1)/2) x (d_h + 1) per key/value head).
- :func:`layer_costs` — everything above for one layer of a megahash config, and beside it (keys
  ``impl_*``) the costs of megahash's implementation of the kind, measured on the meta device
  (:mod:`megahash.models.measured_costs`: GEMM FLOPs, decode cache, saved activations). Where the
  [Xue25] table and the implementation differ both are shown, labelled (``megahash params``,
  ``megahash report``); MFU uses the implemented FLOPs. A kind without a table row or that cannot
  be measured gets "n/a", never an error.
"""

from __future__ import annotations

import inspect

from megahash import catalog
from megahash.models.cost_formulas import GeneralisedRow, StandardQKV  # noqa: F401 - the formula bases

# ----------------------------------------------------------------------------- lookup


def _resolve(kind: str) -> str:
    k = kind.lower()
    return catalog.standard("attention") if k == "standard" else k


def _own(kind: str):
    """The cost class a kind registers in its own file, or None ("measured only" / unknown)."""
    return catalog.costs(_resolve(kind))


def _formula(kind: str, name: str):
    """The kind's formula ``name``, called with the layer's options it names as keywords (``**opts``: a layer's
    options, ``model.attention.options`` with the schedule's per-layer ones on top; e.g. a window, a gate)."""
    own = _own(kind)
    fn = getattr(own, name, None) if own is not None else None
    if fn is None:
        raise KeyError(f"attention kind {kind!r} has no {name} formula")

    def call(*args, **opts):
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            opts = {k: v for k, v in opts.items() if k in params}
        return fn(*args, **opts)

    return call


def _groups(kind: str, n: int, groups: int | None) -> int:
    own = _own(kind)
    g = getattr(own, "groups", None) if own is not None else None
    return g(n, groups) if g is not None else (groups or n)


def thesis_name(kind: str):
    """Row name in the [Xue25] tables ("Standard", "MLP", "SHA", ...) or None."""
    return catalog.caps("attention", _resolve(kind)).thesis_name


def chapter_kinds(chapter: int) -> list[str]:
    """Kinds listed in a chapter's tables (3: Table 3.4; 4: Tables 4.5-4.8)."""
    return catalog.thesis_kinds(chapter)


# ----------------------------------------------------------------------------- Table 3.4


def attention_param_count(kind: str, n: int, d: int, groups: int | None = None, **opts) -> int:
    """Table 3.4: Q/K/V parameters of one attention sublayer (d = head dim, n = heads, d_m = nd),
    the kind's own ``qkv_params`` (e.g. SHA 3d^2n, MHA 3d^2n^2, MHE 3d^2n + 3dn; ``opts``: the layer's options)."""
    return _formula(kind, "qkv_params")(n, d, _groups(kind, n, groups), **opts)


def extra_params_over_sha(kind: str, n: int, d: int) -> int:
    """Table 3.4's last column: parameters beyond single-head attention (the "SHA" row)."""
    sha = catalog.by_thesis_name("SHA")
    if sha is None:
        raise KeyError("no attention kind registers the SHA row of Table 3.4")
    return attention_param_count(kind, n, d) - attention_param_count(sha, n, d)


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
    """Table 3.13's last column: 100 * (1 - total(kind) / total(standard attention))."""
    std = catalog.standard("attention")
    return 100.0 * (1 - memory_usage(kind, n, d, batch, seq)["total"] / memory_usage(std, n, d, batch, seq)["total"])


# ----------------------------------------------------------------------------- Tables 4.5-4.8


def time_complexity(kind: str, B: int, L: int, d: int, **opts) -> int:
    """Table 4.5: leading terms of one forward pass without caching (O(.) value)."""
    return _formula(kind, "time_complexity")(B, L, d, **opts)


def flops(
    kind: str,
    phase: str,
    B: int,
    L: int,
    d: int,
    h: int | None = None,
    precomputed: bool = False,
    groups: int | None = None,
    **opts,
) -> int:
    """Table 4.6: GEMM FLOPs per iteration of one attention sublayer with the cache enabled.

    phase ``prefill`` (B sequences of L tokens) or ``decode`` (one new token per sequence with L
    tokens of context). ``precomputed``: global attention scores cached (sec. 4.13, kinds with a
    fixed input). Generalised rows (:class:`GeneralisedRow`) need ``h``. ``opts``: the layer's options."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, got {phase!r}")
    g = _groups(kind, h, groups) if h is not None else groups
    return _formula(kind, "flops")(phase, B, L, d, h, g, precomputed, **opts)


def flops_per_token(
    kind: str,
    phase: str,
    B: int,
    L: int,
    d: int,
    h: int | None = None,
    precomputed: bool = False,
    groups: int | None = None,
    **opts,
) -> float:
    """Table 4.6 divided by the tokens of the iteration (B*L for prefill, B for decode)."""
    tokens = B * L if phase == "prefill" else B
    return flops(kind, phase, B, L, d, h, precomputed, groups, **opts) / tokens


def activation_memory(kind: str, B: int, L: int, d: int, h: int, t: int = 1, **opts) -> float:
    """Table 4.7: activation memory (bytes, 16-bit, sequence parallel over t) of one attention
    sublayer, attention dropout ignored."""
    return _formula(kind, "activation_bytes")(B, L, d, h, t, **opts)


def cache_bytes(kind: str, B: int, L: int, d: int, h: int, groups: int | None = None, **opts) -> float:
    """Table 4.8: inference cache per layer in bytes (16-bit)."""
    return _formula(kind, "cache_bytes")(B, L, d, h, _groups(kind, h, groups), **opts)


def cache_elements(
    kind: str, B: int, L: int, n: int, d_h: int, groups: int | None = None, frozen: bool = True, **opts
) -> int:
    """Numbers this implementation keeps in its decoding cache per layer (all TP ranks together)
    after L tokens of B sequences: the kind's own ``cache_elements``. ``frozen`` (kinds with a
    fixed input: maps frozen with ``FixedInput.freeze``) and ``opts`` (the layer's options, e.g.
    ``feature_dim``, ``window``) go to it."""
    return _formula(kind, "cache_elements")(B, L, n, d_h, _groups(kind, n, groups), frozen=frozen, **opts)


NA = "n/a"
NOT_MEASURED = "not measured"  # config_costs(measure=False); `megahash params --measure` measures
IMPL_KEYS = (
    "prefill_flops",
    "decode_flops",
    "prefill_flops_per_token",
    "decode_flops_per_token",
    "cache_bytes",
    "activation_bytes",
)
_IMPL_MEMO: dict = {}


def _na(fn, *args, **kw):
    """fn(...) or "n/a" for a kind the formula does not know."""
    try:
        return fn(*args, **kw)
    except (KeyError, ValueError, TypeError, ZeroDivisionError):
        return NA


def implemented_costs(cfg, kind: str, batch: int, seq: int, options: dict | None = None) -> dict:
    """Costs of megahash's implementation of ``kind`` (measured; values "n/a" when not measurable):
    prefill/decode GEMM FLOPs (and per token), decode cache bytes at 16 bit, saved activation bytes
    (16-bit training), one attention sublayer, output projection excluded (as Tables 4.6-4.8); ``options``: the
    layer's own (a schedule's ``KIND+OPTION=VALUE``)."""
    key = (cfg.to_yaml(), kind, batch, seq, tuple(sorted((options or {}).items())))
    if key in _IMPL_MEMO:
        return dict(_IMPL_MEMO[key])
    try:
        from megahash.models.measured_costs import measure_kind

        m = measure_kind(cfg, kind, batch, seq, options)
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


def layer_costs(cfg, kind: str, batch: int, seq: int, measure: bool = True, options: dict | None = None) -> dict:
    """All table values for one layer of kind ``kind`` under a megahash config (``cfg.model``), the
    implementation's measured values (``impl_*``; ``measure=False`` skips them) and ``differs``: the
    quantities where the [Xue25] table and the implementation disagree (beyond 0.5%). The formulas get the
    layer's options (``model.attention.options``, ``options``: the schedule's per-layer ones on top)."""
    m = cfg.model
    n, d = m.num_heads, m.hidden_size
    d_h = d // n
    g = m.num_query_groups or None  # the kind's own ``groups`` turns it into its key/value heads
    t = cfg.parallel.tensor
    name = thesis_name(kind)
    o = {**m.attention.options, **(options or {})}
    out = {
        "kind": kind,
        "thesis_name": name if name else NA,
        "has_formulas": _own(kind) is not None,  # False: "measured only"
        "time_complexity": _na(time_complexity, kind, batch, seq, d, **o),
        "prefill_flops": _na(flops, kind, "prefill", batch, seq, d, n, groups=g, **o),
        "decode_flops": _na(flops, kind, "decode", batch, seq, d, n, groups=g, **o),
        "prefill_flops_per_token": _na(flops_per_token, kind, "prefill", batch, seq, d, n, groups=g, **o),
        "decode_flops_per_token": _na(flops_per_token, kind, "decode", batch, seq, d, n, groups=g, **o),
        "activation_bytes": _na(activation_memory, kind, batch, seq, d, n, t, **o),
        "cache_bytes": _na(cache_bytes, kind, batch, seq, d, n, groups=g, **o),
    }
    if measure:  # the kind's own formula of its implementation's cache
        out["cache_elements_impl"] = _na(cache_elements, kind, batch, seq, n, d_h, groups=g, **o)
    try:
        out["qkv_params"] = attention_param_count(kind, n, d_h, g, **o)
    except (KeyError, ValueError, TypeError):
        out["qkv_params"] = None
    if measure:
        impl = implemented_costs(cfg, kind, batch, seq, options)
        out.update({f"impl_{k}": v for k, v in impl.items()})
        out["differs"] = [
            k for k in ("prefill_flops", "decode_flops", "cache_bytes", "activation_bytes") if _differ(out[k], impl[k])
        ]
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
    "n/a" when a layer's kind has no cost formula and cannot be measured (MFU is then not shown).
    """
    from megahash.models.arch import arch_of
    from megahash.models.schedules import layer_kinds, layer_options

    m = cfg.model
    L = seq or cfg.data.seq_length
    d, n, g = m.hidden_size, m.num_heads, m.num_query_groups or None
    mlp_mats = 3 if arch_of(m.arch).swiglu and m.mlp_activation != "relu2" else 2
    kinds = layer_kinds(m.schedule, m.num_layers)
    per_token = 0.0
    for kind, own in zip(kinds, layer_options(cfg)):
        attn = implemented_costs(cfg, kind, 1, L, own)["prefill_flops_per_token"] if measure else NA
        if not isinstance(attn, (int, float)):  # not measurable: the kind's own Table 4.6 formula
            attn = _na(flops_per_token, kind, "prefill", 1, L, d, n, groups=g, **{**m.attention.options, **own})
            if not isinstance(attn, (int, float)):  # no cost model and not measurable: no MFU
                return NA
        per_token += attn + 2 * d * d + 2 * mlp_mats * d * m.ffn_hidden_size
    per_token += 2 * d * vocab_size
    return 3.0 * per_token


def config_costs(cfg, batch: int = 1, measure: bool = True) -> dict:
    """Per-layer costs of a config (``megahash params`` shows them): Table 4.5-4.8 values at the
    config's sequence length, and the model's training FLOPs per token. ``measure=False`` leaves out
    the implementation's measured values (which import torch and megatron-core) and marks them so."""
    from megahash.models.schedules import layer_kinds, layer_options

    seq = cfg.data.seq_length
    kinds = layer_kinds(cfg.model.schedule, cfg.model.num_layers)
    layers = [layer_costs(cfg, k, batch, seq, measure, o) for k, o in zip(kinds, layer_options(cfg))]
    vocab = cfg.model.vocab_size or 50304

    def total(key):
        vals = [x.get(key, NOT_MEASURED) for x in layers]
        return sum(vals) if all(isinstance(v, (int, float)) for v in vals) else vals[0] if vals else NA

    out = {
        "seq_length": seq,
        "batch": batch,
        "measured": measure,
        "train_flops_per_token": train_flops_per_token(cfg, vocab, seq, measure=measure),
    }
    for key in ("prefill_flops_per_token", "decode_flops_per_token", "cache_bytes", "activation_bytes"):
        out[key] = total(key)  # the [Xue25] tables
        out[f"impl_{key}"] = total(f"impl_{key}")  # this implementation
    out["layers"] = layers
    return out
