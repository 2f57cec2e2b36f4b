"""Layer schedules: a schedule string -> one attention kind per layer ([Xue25] sec. 4.5, Table 4.11).

Forms:
- ``uniform:KIND`` every layer uses KIND.
- ``hybrid:KIND:PRESET`` layers of PRESET keep the standard attention (the kind
  registered with ``AttentionCaps(standard=True)``), the others use KIND.
  Presets (1-based layer ids that keep standard attention, L = number of layers):
  even {2,4,..}, odd {1,3,..}, top {1..L/2}, middle {1..L/4, 3L/4+1..L} (the middle half is
  replaced), bottom {L/2+1..L}, 25% {4,8,..} (every fourth layer), first {1}, last {L},
  bilateral {1, L}. ``hybrid:KIND:1,5,9`` gives the standard layers explicitly.
- ``list:K1,K2,...`` an explicit kind per layer (length L); ``K*n`` repeats (``list:mha*2,mlp*2``).
- ``hybrid:KIND:PRESET:STANDARD`` uses STANDARD instead of the standard kind for the kept layers.

The [Xue25] 500M hybrid (RndEmbQK in odd layers, standard in even) is ``hybrid:rndembqk:even``.
``model.attention.skip_nonstandard=true`` evaluates a hybrid with its non-standard layers dropped
(`skip`, see :func:`skip_mask`).
"""

from __future__ import annotations

from megahash.errors import ConfigError

PRESETS = ("even", "odd", "top", "middle", "bottom", "25%", "first", "last", "bilateral")


def standard_layers(preset: str, num_layers: int) -> set[int]:
    """1-based ids of the layers a hybrid preset keeps standard (Table 4.11, generalised to any L)."""
    L = num_layers
    half, quarter = L // 2, L // 4
    table = {
        "even": set(range(2, L + 1, 2)),
        "odd": set(range(1, L + 1, 2)),
        "top": set(range(1, half + 1)),
        "middle": set(range(1, quarter + 1)) | set(range(L - quarter + 1, L + 1)),
        "bottom": set(range(half + 1, L + 1)),
        "25%": set(range(4, L + 1, 4)),
        "first": {1},
        "last": {L},
        "bilateral": {1, L},
    }
    if preset in table:
        return table[preset]
    try:
        ids = {int(x) for x in preset.split(",") if x.strip()}
    except ValueError:
        raise ConfigError(
            f"unknown hybrid preset {preset!r}; use one of {', '.join(PRESETS)} or a list of layer ids like 1,4,8"
        ) from None
    bad = sorted(i for i in ids if not 1 <= i <= L)
    if bad:
        raise ConfigError(f"hybrid layer ids {bad} are outside 1..{L}")
    return ids


def _expand_list(items: str) -> list[str]:
    out: list[str] = []
    for item in items.split(","):
        item = item.strip()
        if not item:
            continue
        if "*" in item:
            kind, n = item.rsplit("*", 1)
            out.extend([kind] * int(n))
        else:
            out.append(item)
    return out


def layer_kinds(schedule: str, num_layers: int, known: set[str] | None = None) -> list[str]:
    """Parse a schedule into ``num_layers`` attention kind names (validated against ``known``)."""
    parts = schedule.split(":")
    form = parts[0]
    if form == "uniform" and len(parts) == 2:
        kinds = [parts[1]] * num_layers
    elif form == "hybrid" and len(parts) in (3, 4):
        kind, preset = parts[1], parts[2]
        std = parts[3] if len(parts) == 4 else _standard()
        keep = standard_layers(preset, num_layers)
        kinds = [std if i in keep else kind for i in range(1, num_layers + 1)]
    elif form == "list" and len(parts) == 2:
        kinds = _expand_list(parts[1])
        if len(kinds) != num_layers:
            raise ConfigError(f"schedule {schedule!r} lists {len(kinds)} layers but model.num_layers={num_layers}")
    else:
        raise ConfigError(f"bad schedule {schedule!r}; use uniform:KIND, hybrid:KIND:PRESET or list:K1,K2,...")
    if known is not None:
        for k in kinds:
            if k not in known:
                import difflib

                close = difflib.get_close_matches(k, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
                raise ConfigError(f"unknown attention kind {k!r} in schedule {schedule!r}{hint}")
    return kinds


def standard_kind(schedule: str) -> str:
    """The kind a schedule counts as standard: STANDARD of ``hybrid:KIND:PRESET:STANDARD``, else ``mha``."""
    parts = schedule.split(":")
    if parts[0] == "hybrid" and len(parts) == 4:
        return parts[3]
    return _standard()


def _standard() -> str:
    """The registered standard attention kind (``AttentionCaps(standard=True)``)."""
    from megahash import catalog

    return catalog.standard("attention")


def skip_mask(kinds: list[str], standard: str | None = None) -> list[bool]:
    """`skip` evaluation mode ([Xue25] sec. 4.4.2/4.5, Table 4.1 "HYBRID SKIP"): True for the layers
    to drop, i.e. every non-standard layer. The model drops a skipped layer whole (attention and
    MLP become an identity, ``registry.SkippedLayer``): [Xue25] removes the odd (non-standard)
    layers of a pre-trained hybrid so information flows only through the residual connections."""
    standard = standard or _standard()
    return [k != standard for k in kinds]


def check_kinds(cfg) -> list[str]:
    """Layer kinds of ``model.schedule``, checked with the kinds' source (milliseconds, no torch): an
    unknown attention kind or embedding is a one-line ConfigError."""
    from megahash import catalog
    from megahash.errors import did_you_mean

    m = cfg.model
    catalog.add_plugins(getattr(m, "plugins", None))
    kinds = layer_kinds(m.schedule, m.num_layers, known=set(catalog.names("attention")))
    embeddings = catalog.names("embedding")
    if m.embedding not in embeddings:
        raise ConfigError(f"unknown model.embedding {m.embedding!r}{did_you_mean(m.embedding, embeddings)}")
    from megahash.config_checks import check_documents, check_encoder, check_mup
    from megahash.models.arch import arch_of

    check_encoder(cfg, arch_of(m.arch).causal, kinds, lambda k: catalog.caps("attention", k))  # model.arch=encoder
    check_documents(cfg, kinds, lambda k: catalog.caps("attention", k))  # data.reset_attention_mask
    check_mup(cfg, kinds, lambda k: catalog.caps("attention", k))  # model.mup_base_hidden_size
    return kinds
