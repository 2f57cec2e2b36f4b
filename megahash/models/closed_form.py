"""``megahash params`` without torch: parameter counts in closed form.

- :func:`closed_form_report` is ``megahash params`` for a plain Qwen2 decoder (embedding, head and
  every attention kind registered with ``caps.qwen2``), in closed form: QKV the kind's Table 3.4
  formula ``h (n + 2g) d_h`` (+ ``(n + 2g) d_h`` bias; the layer's options go to the formula, e.g. an output
  gate's ``h n d_h``), output ``h^2``, SwiGLU ``3 h ffn`` (ReLU squared ``2 h ffn``), two RMSNorms ``2h``
  per layer, final norm ``h``, embedding ``V' h`` with ``V'`` Megatron's padded vocabulary (+ ``V' h``
  untied head), the residual mixing's scalars (``2L`` with ``model.x0_mix``, ``L // 2`` with
  ``model.unet_skips``). Other variants (``model.value_embeds`` too) return None and are counted on a meta-device model (tests check
  both agree).
"""

from __future__ import annotations

from megahash.models.cost_formulas import padded_vocab_size


def closed_form_report(cfg, vocab_size: int) -> dict | None:
    """``megahash params`` report of the standard decoder in closed form (None: not covered); its
    costs are the [Xue25] table rows (the implementation's are measured by ``megahash params --measure``)."""
    from megahash.models.costs import attention_param_count
    from megahash.models.schedules import check_kinds, layer_options

    m = cfg.model
    kinds = check_kinds(cfg)
    if not is_qwen2(cfg) or m.value_embeds:  # only plain Qwen2 parts (caps.qwen2) have a closed form here
        return None
    h, n = m.hidden_size, m.num_heads
    d_h = h // n
    V = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by)
    layers = []
    for kind, own in zip(kinds, layer_options(cfg)):
        options = {**m.attention.options, **own}  # the layer's options (e.g. an output gate's parameters)
        qkv = attention_param_count(kind, n, d_h, m.num_query_groups or None, **options)  # its Table 3.4 formula
        width = qkv // h  # (n + 2g) d_h output features of the Q/K/V projections
        layers.append(
            {
                "kind": kind,
                "attention": {"qkv": qkv + (width if m.qkv_bias else 0), "out": h * h},
                "mlp": (2 if m.mlp_activation == "relu2" else 3) * h * m.ffn_hidden_size,  # relu2: two matrices
                "norm": 2 * h,
            }
        )
    emb, head = V * h, 0 if m.tie_embeddings else V * h
    from megahash import catalog

    extras = {f"embedding_{k}": n for k, n in catalog.input_params(cfg).items()}  # inputs of their own
    L = m.num_layers  # model.x0_mix: (a_i, b_i) per layer; model.unet_skips: one weight per skip
    residual = (2 * L if m.x0_mix else 0) + (L // 2 if m.unet_skips else 0)
    total = (
        residual
        + sum(extras.values())
        + emb
        + head
        + h
        + sum(L["attention"]["qkv"] + L["attention"]["out"] + L["mlp"] + L["norm"] for L in layers)
    )
    report = {
        "total": total,
        "embedding": emb,
        **extras,
        "head": head,
        "tied_head": bool(m.tie_embeddings),
        "final_norm": h,
        "residual_mix": residual,
        "value_embeds": 0,  # model.value_embeds > 0 has no closed form here (None above)
        "vocab_size": V,
        "layers": layers,
    }
    from megahash.models.costs import config_costs

    report["costs"] = config_costs(cfg, measure=False)
    return report


def is_qwen2(cfg) -> bool:
    """A plain Qwen2 model: decoder, clm, Qwen2-type embedding, head and every attention layer."""
    from megahash import catalog
    from megahash.models.arch import arch_of
    from megahash.models.schedules import layer_kinds
    from megahash.objective_spec import objective_spec

    m = cfg.model
    if not (arch_of(m.arch).causal and objective_spec(cfg.train.objective).next_token):
        return False
    if not (catalog.caps("embedding", m.embedding).qwen2 and catalog.caps("head", m.head).qwen2):
        return False
    return all(catalog.caps("attention", k).qwen2 for k in layer_kinds(m.schedule, m.num_layers))
