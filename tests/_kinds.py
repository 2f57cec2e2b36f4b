"""The kinds the tests run, read from the registry (megahash.catalog, no torch): a newly
registered attention kind, embedding kind or head gets every registry-driven test without a test edit."""

from __future__ import annotations

from megahash import catalog


def _select(group: str, caps: dict) -> list[str]:
    return sorted(
        n for n in catalog.names(group) if all(getattr(catalog.caps(group, n), k) == v for k, v in caps.items())
    )


def attention(**caps) -> list[str]:
    """Registered attention kinds whose capabilities match ``caps`` (e.g. decodes=True)."""
    return _select("attention", caps)


def embeddings(**caps) -> list[str]:
    return _select("embedding", caps)


def heads(**caps) -> list[str]:
    return _select("head", caps)


def with_formula(name: str) -> list[str]:
    """Attention kinds whose cost class has the formula ``name`` (e.g. qkv_params)."""
    return [k for k in attention() if getattr(catalog.costs(k), name, None) is not None]


def examples(kind: str) -> tuple:
    """The per-layer option settings the kind's options class lists for these tests (``EXAMPLES``: schedule-item
    suffixes, "" = the defaults), or ("",)."""
    cls = catalog.options_class("attention", kind)
    return tuple(getattr(cls, "EXAMPLES", None) or ("",))


def variants(**caps) -> list[str]:
    """Schedule items of the attention kinds matching ``caps``: each kind with each of its examples (``swa+window=4``,
    ``mha+gated``; ``KIND+OPTION=VALUE`` sets the option for that layer), so a newly declared option joins every
    registry-driven test as a kind does."""
    return [k if not e else f"{k}+{e}" for k in attention(**caps) for e in examples(k)]


def kind(item: str) -> str:
    """The kind name of a schedule item (``swa+window=4`` -> ``swa``)."""
    from megahash.models.schedules import split_item

    return split_item(item)[0]


def options(item: str) -> dict:
    """The typed per-layer options of a schedule item (``swa+window=4`` -> {"window": 4}), as the schedule gives
    them to the layer (and the cost formulas take them)."""
    from megahash.config_checks import coerce
    from megahash.models.schedules import split_item

    specs = catalog.option_specs("attention")
    return {k: True if v is None else coerce(v, specs[k].type, k) for k, v in split_item(item)[1].items()}
