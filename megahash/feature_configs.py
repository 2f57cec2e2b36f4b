"""The sections of ``train`` that the training features declare in their own files, read torch-free.

A training feature is a module named in ``FEATURES`` of megahash/training/hooks.py (or, outside the package,
in ``MEGAHASH_FEATURES``: comma-separated module names). One that defines a top-level dataclass ``Config``
owns the section ``train.<module name>`` (torchtitan's per-component ``.Config``): ``train.ema.decay`` is the
field ``decay`` of ``Config`` in megahash/training/ema.py, its range in the field's metadata
(``config_checks.ranged``), its choices a ``Literal``; a ``check(self, cfg)`` method holds the section's rules
across keys (one-line ConfigError), run with the other config checks.

The files are read as the kinds are (megahash/kind_source.py: the class executed with only what it uses of
its file and of torch-free modules), so loading a config imports no feature module, no torch, and nothing of
``megahash.training`` (evaluation and conversion read configs and must not depend on the training loop: an
import-linter contract). Only the head of a file is parsed, up to the end of ``class Config`` (and of
``FEATURES`` in hooks.py): ``Config`` and what it uses come right after the imports.
"""

from __future__ import annotations

import functools
import os

from megahash import kind_source
from megahash.errors import ConfigError

HOOKS = kind_source.ROOT / "training" / "hooks.py"  # where FEATURES, the list of the training features, is
FEATURES_ENV = "MEGAHASH_FEATURES"


def feature_modules() -> list[str]:
    """Module names of the training features: the library's (``hooks.FEATURES``, in their order), then
    ``MEGAHASH_FEATURES``'."""
    names = [f"megahash.training.{n}" for n in kind_source.read_head(HOOKS, "FEATURES").value("FEATURES")]
    names += [n.strip() for n in os.environ.get(FEATURES_ENV, "").split(",") if n.strip()]
    return list(dict.fromkeys(names))


@functools.cache
def sections() -> tuple[tuple[str, type], ...]:
    """((section name, its ``Config`` class), ...) of every training feature that declares one, in
    feature order. A name that is no module, or a section that is not a dataclass, is one line."""
    import dataclasses

    out = []
    for module in feature_modules():
        path = kind_source.module_file(module)
        if path is None:
            raise ConfigError(f"training feature {module!r} cannot be found; check {FEATURES_ENV} and PYTHONPATH")
        head = kind_source.read_head(path, "Config")
        if head is None:
            continue
        cls = head.value("Config")
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{path}: Config of training feature {module!r} must be a dataclass")
        out.append((module.rsplit(".", 1)[-1], cls))
    return tuple(out)
