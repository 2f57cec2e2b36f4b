"""Layer schedules: a schedule string -> one attention kind (and its options) per layer ([Xue25] sec. 4.5,
Table 4.11).

Forms:
- ``uniform:KIND`` every layer uses KIND.
- ``hybrid:KIND:PRESET`` layers of PRESET keep the standard attention (the kind
  registered with ``AttentionCaps(standard=True)``), the others use KIND.
  Presets (1-based layer ids that keep standard attention, L = number of layers):
  even {2,4,..}, odd {1,3,..}, top {1..L/2}, middle {1..L/4, 3L/4+1..L} (the middle half is
  replaced), bottom {L/2+1..L}, 25% {4,8,..} (every fourth layer), first {1}, last {L},
  bilateral {1, L} (Table 4.11); ``NtoM`` N layers of KIND then M standard ones, repeated (``3to1``:
  Qwen3-Next's three linear layers per softmax layer, = 25%; ``5to1``: Gemma 3's five local layers per
  global one; ``1to1`` = even); ``nanogpt`` {1, 5, L-4, L} (modded-nanogpt's long-window layers: 1, 5, 8,
  12 of 12). ``hybrid:KIND:1,5,9`` gives the standard layers explicitly.
- ``list:K1,K2,...`` an explicit kind per layer (length L); ``K*n`` repeats (``list:mha*2,mlp*2``).
- ``hybrid:KIND:PRESET:STANDARD`` uses STANDARD instead of the standard kind for the kept layers.

Per-layer options: a kind in any form may carry options of its own for its layers, ``KIND+OPTION=VALUE``
(``+OPTION`` alone: a true flag), e.g. ``hybrid:swa+window=64:nanogpt:swa+window=128`` or
``hybrid:KIND:3to1:mha+gated``; they override ``model.attention.options`` for those layers only (checked as the
kind declares the option: its type and range; an option it does not declare is a one-line error).

The [Xue25] 500M hybrid (RndEmbQK in odd layers, standard in even) is ``hybrid:rndembqk:even``.
``model.attention.skip_nonstandard=true`` evaluates a hybrid with its non-standard layers dropped
(`skip`, see :func:`skip_mask`).
"""

from __future__ import annotations

import re

from megahash.errors import ConfigError

PRESETS = ("even", "odd", "top", "middle", "bottom", "25%", "first", "last", "bilateral")  # Table 4.11
RATIO = re.compile(r"^([1-9][0-9]*)to([1-9][0-9]*)$")  # NtoM: N layers of the kind, then M standard ones


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
        "nanogpt": {i for i in (1, 5, L - 4, L) if 1 <= i <= L},  # modded-nanogpt's long windows (12 layers)
    }
    if preset in table:
        return table[preset]
    ratio = RATIO.match(preset)
    if ratio:
        n, m = int(ratio.group(1)), int(ratio.group(2))
        return {i for i in range(1, L + 1) if (i - 1) % (n + m) >= n}
    try:
        ids = {int(x) for x in preset.split(",") if x.strip()}
    except ValueError:
        raise ConfigError(
            f"unknown hybrid preset {preset!r}; use one of {', '.join(PRESETS)}, NtoM (e.g. 3to1), nanogpt "
            "or a list of layer ids like 1,4,8"
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
            try:
                out.extend([kind] * int(n))
            except ValueError:
                raise ConfigError(f"bad repeat {item!r} in a list schedule; use KIND*N, e.g. mha*2") from None
        else:
            out.append(item)
    return out


def split_item(item: str) -> tuple[str, dict]:
    """A schedule's layer item ``KIND+OPTION=VALUE+FLAG`` -> (KIND, {OPTION: "VALUE", FLAG: None})."""
    name, *opts = item.split("+")
    out = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not key or (eq and not value):
            raise ConfigError(f"bad option {opt!r} in schedule item {item!r}; use KIND+OPTION=VALUE or KIND+FLAG")
        out[key] = value if eq else None
    return name, out


def layer_items(schedule: str, num_layers: int) -> list[str]:
    """Parse a schedule into ``num_layers`` layer items (a kind name with its per-layer options)."""
    parts = schedule.split(":")
    form = parts[0]
    if form == "uniform" and len(parts) == 2:
        return [parts[1]] * num_layers
    if form == "hybrid" and len(parts) in (3, 4):
        kind, preset = parts[1], parts[2]
        std = parts[3] if len(parts) == 4 else _standard()
        keep = standard_layers(preset, num_layers)
        return [std if i in keep else kind for i in range(1, num_layers + 1)]
    if form == "list" and len(parts) == 2:
        items = _expand_list(parts[1])
        if len(items) != num_layers:
            raise ConfigError(f"schedule {schedule!r} lists {len(items)} layers but model.num_layers={num_layers}")
        return items
    raise ConfigError(f"bad schedule {schedule!r}; use uniform:KIND, hybrid:KIND:PRESET or list:K1,K2,...")


def named_items(schedule: str, num_layers: int) -> list[str]:
    """Every item a schedule names, used by a layer or not (a hybrid's STANDARD when its preset keeps no layer of
    this depth): each is checked, so a typo fails at any depth."""
    parts = schedule.split(":")
    named = [] if parts[0] == "list" else [parts[1]] + (parts[3:4] if parts[0] == "hybrid" else [])
    items = layer_items(schedule, num_layers)
    return list(dict.fromkeys(items + [item for item in named if item not in items]))


def layer_kinds(schedule: str, num_layers: int, known: set[str] | None = None) -> list[str]:
    """Parse a schedule into ``num_layers`` attention kind names (every named kind validated against ``known``)."""
    kinds = [split_item(item)[0] for item in layer_items(schedule, num_layers)]
    if known is not None:
        for k in [split_item(item)[0] for item in named_items(schedule, num_layers)]:
            if k not in known:
                import difflib

                close = difflib.get_close_matches(k, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
                raise ConfigError(f"unknown attention kind {k!r} in schedule {schedule!r}{hint}")
    return kinds


def layer_options(cfg) -> list[dict]:
    """The per-layer options of ``model.schedule`` ({} for a layer without), typed and checked against what the
    layer's kind declares (:func:`megahash.catalog.option_specs`; every item the schedule names, used at this depth
    or not): a one-line ConfigError otherwise. A layer's options are ``model.attention.options`` with these on top."""
    from megahash import catalog

    m = cfg.model
    specs = catalog.option_specs("attention")
    typed = {item: _typed_options(item, specs) for item in named_items(m.schedule, m.num_layers)}
    return [typed[item] for item in layer_items(m.schedule, m.num_layers)]


def _typed_options(item: str, specs: dict) -> dict:
    """The options of one schedule item, typed and checked against what its kind declares (``specs``)."""
    from megahash.config_checks import check_value, coerce
    from megahash.errors import did_you_mean

    name, raw = split_item(item)
    own = sorted(o for o, spec in specs.items() if name in spec.kinds)
    typed = {}
    for key, value in raw.items():
        if key not in own:
            hint = did_you_mean(key, own) if own else " (it declares no options)"
            raise ConfigError(f"attention kind {name!r} has no option {key!r} in schedule item {item!r}{hint}")
        spec = specs[key]
        if value is None and spec.type is not bool:
            raise ConfigError(f"option {key!r} of {name!r} needs a value: {name}+{key}=VALUE (schedule item {item!r})")
        dotted = f"{name}+{key} (model.schedule)"
        typed[key] = True if value is None else coerce(value, spec.type, dotted)
        check_value(dotted, typed[key], spec.range)
    return typed


def standard_kind(schedule: str) -> str:
    """The kind a schedule counts as standard: STANDARD of ``hybrid:KIND:PRESET:STANDARD``, else ``mha``."""
    parts = schedule.split(":")
    if parts[0] == "hybrid" and len(parts) == 4:
        return split_item(parts[3])[0]
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
    unknown attention kind, embedding or head is a one-line ConfigError."""
    from megahash import catalog
    from megahash.errors import did_you_mean

    m = cfg.model
    catalog.add_plugins(getattr(m, "plugins", None))
    kinds = layer_kinds(m.schedule, m.num_layers, known=set(catalog.names("attention")))
    layer_options(cfg)  # per-layer options: declared by the layer's kind, of its type and range
    embeddings = catalog.names("embedding")
    if m.embedding not in embeddings:
        raise ConfigError(f"unknown model.embedding {m.embedding!r}{did_you_mean(m.embedding, embeddings)}")
    heads = sorted(n for n in catalog.names("head") if catalog.caps("head", n).selectable)
    if m.head not in heads:  # was found only when the model was built, after torch and megatron-core
        raise ConfigError(f"unknown model.head {m.head!r}{did_you_mean(m.head, heads)}")
    from megahash.config_checks import check_documents, check_encoder, check_mup, check_value_embeds
    from megahash.models.arch import arch_of

    check_encoder(cfg, arch_of(m.arch).causal, kinds, lambda k: catalog.caps("attention", k))  # model.arch=encoder
    check_documents(cfg, kinds, lambda k: catalog.caps("attention", k))  # data.reset_attention_mask
    check_mup(cfg, kinds, lambda k: catalog.caps("attention", k))  # model.mup_base_hidden_size
    check_value_embeds(cfg, kinds, lambda k: catalog.caps("attention", k))  # model.value_embeds
    return kinds
