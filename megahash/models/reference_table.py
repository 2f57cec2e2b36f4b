"""{kind name: its class} for :mod:`megahash.models.reference_layers` (attention: the kind written once, whose
plain-torch layer the shell derives; embedding, head, input: the plain-torch reference).

In the library this is the registry's view :func:`megahash.models.registry.references` (every kind file
imported, so every kind's class sits in its ``KindSpec``). ``megahash export-hf``
does not copy this file: it writes a ``reference_table.py`` of its own that imports the extracted
reference of each kind the model uses (:mod:`megahash.convert.remote_code`).
"""

from __future__ import annotations


def references() -> dict:
    from megahash.models import registry

    return registry.references()
