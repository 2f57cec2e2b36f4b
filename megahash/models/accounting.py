"""Parameter accounting of a config (``megahash params``): total, embedding, head, and per layer
attention ``qkv`` (all attention parameters but the output projection) and ``out``, MLP and norms.

The model is built on the ``meta`` device at TP=1, so even the 1.7B config costs no memory.
"""

from __future__ import annotations


def _n(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def count_parameters(cfg, vocab_size: int) -> dict:
    import torch  # here, not at the top: format_report and megahash/models/closed_form.py stay torch-free

    from megahash.accelerator import process_groups
    from megahash.models.megatron_model import build_model

    cfg.parallel.tensor, cfg.parallel.sequence = 1, False
    process_groups.init_distributed(1)
    with torch.device("meta"):
        model = build_model(cfg, vocab_size, init=False)
    layers = []
    for kind, layer in zip(model.layer_kinds, model.decoder.layers):
        att = layer.self_attention
        out = _n(getattr(att, "linear_proj", None))
        layers.append(
            {
                "kind": kind,
                "attention": {"qkv": _n(att) - out, "out": out},
                "mlp": _n(layer.mlp),
                "norm": _n(layer.input_layernorm) + _n(layer.pre_mlp_layernorm),
            }
        )
    emb_report = getattr(model.embedding, "param_report", None)
    emb = emb_report() if callable(emb_report) else {"embedding": _n(model.embedding)}
    head = _n(model.output_layer) + _n(getattr(model, "head", None))
    report = {
        "total": _n(model),
        "embedding": emb.get("embedding", _n(model.embedding)),
        **{f"embedding_{k}": v for k, v in emb.items() if k != "embedding"},
        **{k: v for extra in model.kind_inputs() for k, v in extra.param_report().items()},  # e.g. an n-gram table
        "head": head,
        "tied_head": bool(model.tie),
        "final_norm": _n(getattr(model.decoder, "final_layernorm", None)),
        "residual_mix": _n(getattr(model.decoder, "residual", None)),  # model.x0_mix / model.unet_skips scalars
        "value_embeds": _n(getattr(model, "value_embeds", None)),  # model.value_embeds: tables and gains
        "vocab_size": model.vocab_size,
        "layers": layers,
    }
    costs = _costs(cfg)
    if costs:
        report["costs"] = costs
    return report


def _costs(cfg) -> dict | None:
    try:
        from megahash.models import costs
    except ImportError:
        return None
    fn = getattr(costs, "config_costs", None)
    return fn(cfg) if callable(fn) else None


def format_report(r: dict) -> str:
    lines = [
        f"total parameters   {r['total']:>15,}",
        f"embedding          {r['embedding']:>15,}",
    ]
    for k, v in r.items():
        if k.startswith("embedding_") and isinstance(v, int):
            lines.append(f"  {k[10:]:<17}{v:>15,}")
    lines += [
        f"head               {r['head']:>15,}{'  (tied to the embedding)' if r['tied_head'] else ''}",
        f"final norm         {r['final_norm']:>15,}",
        *([f"residual mixing    {r['residual_mix']:>15,}"] if r.get("residual_mix") else []),
        *([f"value embeddings   {r['value_embeds']:>15,}"] if r.get("value_embeds") else []),
        "",
        f"{'layer':>5} {'kind':<12} {'attn qkv':>12} {'attn out':>12} {'mlp':>12} {'norm':>8}",
    ]
    for i, L in enumerate(r["layers"], 1):
        lines.append(
            f"{i:>5} {L['kind']:<12} {L['attention']['qkv']:>12,} {L['attention']['out']:>12,} "
            f"{L['mlp']:>12,} {L['norm']:>8,}"
        )
    c = r.get("costs")
    if c:
        basis = "implemented attention GEMMs" if c.get("measured", True) else "thesis-table attention rows"
        tf = c["train_flops_per_token"]
        tf = f"{tf:.4g} FLOPs/token ({basis})" if isinstance(tf, (int, float)) else "n/a FLOPs/token (MFU n/a)"
        lines += ["", f"at sequence {c['seq_length']} (batch {c['batch']}): training {tf}, summed over the layers:"]
        if not c.get("measured", True):  # closed form: the table rows only, and how to get the implemented ones
            lines.append(
                "  the implementation's costs: add --measure (a meta-device model: imports torch and "
                "megatron-core, ~6 s of CPU; pretrain's MFU and `megahash report` always measure)"
            )
        lines += [
            f"  attention kind {k}: no cost model and not measurable: its costs are n/a" for k in unmodelled_kinds(c)
        ]
        lines += cost_rows(c)
    return "\n".join(lines)


def unmodelled_kinds(c: dict) -> list[str]:
    """Kinds of a config_costs() result with neither a cost formula nor a measurement."""
    out = []
    for L in c.get("layers", []):
        measured = isinstance(L.get("impl_prefill_flops"), (int, float))
        if not L.get("has_formulas", True) and not measured and L["kind"] not in out:
            out.append(L["kind"])
    return out


def _fmt(v, scale: float = 1.0, unit: str = "") -> str:
    return f"{v / scale:.4g}{unit}" if isinstance(v, (int, float)) else "not measured" if v is None else str(v)


def cost_rows(c: dict) -> list[str]:
    """Implemented vs [Xue25] table costs, model totals then one block per attention kind (labelled;
    '*' marks where the two differ)."""
    quantities = (
        ("prefill_flops_per_token", "attention prefill FLOPs/token", 1, ""),
        ("decode_flops_per_token", "attention decode FLOPs/token", 1, ""),
        ("cache_bytes", "inference cache (16-bit)", 2**20, " MiB"),
        ("activation_bytes", "saved activations (16-bit)", 2**20, " MiB"),
    )
    measured = c.get("measured", True)  # False: no "implemented" column (format_report says how to measure)
    impl_head = f"{'implemented':>16} " if measured else ""
    rows = [f"  {'':<34} {impl_head}{'thesis table':>16}"]
    for key, label, scale, unit in quantities:
        impl = f"{_fmt(c.get('impl_' + key), scale, unit):>16} " if measured else ""
        rows.append(f"  {label:<34} {impl}{_fmt(c.get(key), scale, unit):>16}")
    seen = {}
    for L in c.get("layers", []):
        seen.setdefault(L["kind"], L)
    rows += [
        "",
        "  per layer of each kind (thesis row in brackets"
        + ("; * = implementation differs from the table):" if measured else "):"),
    ]
    for kind, L in seen.items():
        rows.append(f"  {kind} [{L.get('thesis_name', 'n/a')}]")
        for key, label, scale, unit in quantities:
            if key.endswith("per_token"):
                impl, thesis = L.get("impl_" + key), L.get(key)
                mark = "*" if key.replace("_per_token", "") in L.get("differs", []) else " "
            else:
                impl, thesis = L.get("impl_" + key), L.get(key)
                mark = "*" if key in L.get("differs", []) else " "
            impl = f"{_fmt(impl, scale, unit):>16} " if measured else ""
            rows.append(f"   {mark}{label:<32} {impl}{_fmt(thesis, scale, unit):>16}")
    return rows
