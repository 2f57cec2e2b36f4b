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
