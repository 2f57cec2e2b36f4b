"""What can be known of a config without importing torch, megatron-core or DeepSpeed.

- :func:`registered_names` reads the ``@register_attention("...")`` / ``@register_embedding("...")``
  decorators of the kind files with :mod:`ast` (each kind stays one self-describing file; nothing
  here names a kind), so a misspelt schedule or embedding fails in milliseconds.
- :func:`check_kinds` validates ``model.schedule`` and ``model.embedding`` against them.
- :func:`closed_form_report` is ``megahash params`` for the standard decoder (``vocab`` embedding and
  head; ``mha`` layers, GQA via ``model.num_query_groups``, and ``mqa``), in closed form:
  QKV ``h (n + 2g) d_h`` (+ ``(n + 2g) d_h`` bias), output ``h^2``, SwiGLU ``3 h ffn``, two RMSNorms ``2h``
  per layer, final norm ``h``, embedding ``V' h`` with ``V'`` Megatron's padded vocabulary (+ ``V' h``
  untied head). Other variants return None and are counted on a meta-device model (tests check
  both agree).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

from megahash.errors import ConfigError

_MODELS = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def registered_names(decorator: str) -> frozenset:
    """Names given to ``@decorator("name")`` anywhere under megahash/models (source, not imports)."""
    names = set()
    for path in _MODELS.rglob("*.py"):
        src = path.read_text()
        if decorator not in src:
            continue
        for node in ast.walk(ast.parse(src)):
            for dec in getattr(node, "decorator_list", []):
                if (isinstance(dec, ast.Call) and getattr(dec.func, "id", None) == decorator and dec.args
                        and isinstance(dec.args[0], ast.Constant)):
                    names.add(dec.args[0].value)
    return frozenset(names)


def check_kinds(cfg) -> list[str]:
    """Layer kinds of ``model.schedule``; unknown kinds or embeddings raise one-line ConfigErrors."""
    from megahash.config import _suggest
    from megahash.models.schedules import layer_kinds

    m = cfg.model
    kinds = layer_kinds(m.schedule, m.num_layers, known=set(registered_names("register_attention")))
    embeddings = registered_names("register_embedding")
    if m.embedding not in embeddings:
        raise ConfigError(f"unknown model.embedding {m.embedding!r}{_suggest(m.embedding, embeddings)}")
    return kinds


def padded_vocab_size(vocab: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of divisible_by x TP."""
    mult = max(1, divisible_by * tp)
    return ((vocab + mult - 1) // mult) * mult


def closed_form_report(cfg, vocab_size: int) -> dict | None:
    """``megahash params`` report of the standard decoder in closed form (None: not covered); its
    costs are the thesis-table rows (the implementation's are measured by ``megahash params --measure``)."""
    m = cfg.model
    kinds = check_kinds(cfg)
    if (m.arch != "decoder" or m.embedding != "vocab" or m.head != "vocab" or cfg.train.objective != "clm"
            or any(k not in ("mha", "mqa") for k in kinds)):
        return None
    h, n = m.hidden_size, m.num_heads
    d_h = h // n
    V = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by)
    layers = []
    for kind in kinds:
        g = 1 if kind == "mqa" else (m.num_query_groups or n)
        width = (n + 2 * g) * d_h
        layers.append({"kind": kind, "attention": {"qkv": h * width + (width if m.qkv_bias else 0), "out": h * h},
                       "mlp": 3 * h * m.ffn_hidden_size, "norm": 2 * h})
    emb, head = V * h, 0 if m.tie_embeddings else V * h
    total = emb + head + h + sum(L["attention"]["qkv"] + L["attention"]["out"] + L["mlp"] + L["norm"] for L in layers)
    report = {"total": total, "embedding": emb, "head": head, "tied_head": bool(m.tie_embeddings), "final_norm": h,
              "vocab_size": V, "layers": layers}
    from megahash.models.costs import config_costs

    report["costs"] = config_costs(cfg, measure=False)
    return report
