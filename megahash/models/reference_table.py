"""{kind name: its plain-torch reference class} for :mod:`megahash.models.reference_layers`.

In the library this is the registry's ``REFERENCES`` (every kind file imported, so every
``@register_reference`` line has run). ``megahash export-hf`` does not copy this file: it writes a
``reference_table.py`` of its own that imports the extracted reference of each kind the model uses
(:mod:`megahash.convert.remote_code`).
"""
from __future__ import annotations


def references() -> dict:
    import megahash.models.heads  # noqa: F401  (the head references)
    from megahash.models import registry

    registry._load_variants()  # the attention and embedding kind files
    return registry.REFERENCES
