"""What each training objective (``train.objective``) says about itself.

Every objective is one file of :mod:`megahash.objectives` that ends with
``register_objective(ObjectiveSpec(name, ...))``; the library asks ``objective_spec(name).token_loss``
(or another field), never compares the name. The objective files import torch only inside their
functions, so config checks and ``megahash params`` read the specs without it. This module sits beside
the objectives package, not in it: the model layer asks it (which head, is it the plain causal LM) while
the objectives read the model layer's kind capabilities.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from megahash.errors import ConfigError

PACKAGE = "megahash.objectives"


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective: how it makes a training batch and what its loss means."""

    name: str
    token_loss: bool = True  # the loss is nats per vocabulary token of model.head's targets (else its head's classes)
    next_token: bool = False  # predicts the next token: perplexity and bits per byte, lm-eval scoring, Qwen2 export
    corrupt: Callable | None = (
        None  # corrupt(tokens, hash_codes, generator, special_ids, **kw) -> batch; None: the dataset's shifted batch
    )
    options: Callable | None = None  # options(cfg, vocab_size) -> extra ``corrupt`` keywords (None: none)
    head: str | None = None  # a head of its own (registered selectable=False), trained instead of model.head
    arch: str = "decoder"  # the model.arch it is made for (examples and tests; not enforced)
    roles: tuple[
        str, ...
    ] = ()  # special tokens its corruption writes (data.special_ids roles): checked before training
    standard: bool = False  # the default train.objective

    def head_name(self, model_head: str) -> str:
        """The head the model trains: the objective's own, else ``model.head``."""
        return self.head or model_head


_SPECS: dict[str, ObjectiveSpec] = {}
_LOADED: list = []


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    _SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Forget a registered objective (tests, plugins); an unknown name is a no-op."""
    _SPECS.pop(name, None)


def _load() -> None:
    """Import every module of :mod:`megahash.objectives` once (each registers its objective)."""
    if _LOADED:
        return
    pkg = importlib.import_module(PACKAGE)
    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{PACKAGE}.{info.name}")
    _LOADED.append(True)


def names() -> list[str]:
    """Registered objective names, sorted."""
    _load()
    return sorted(_SPECS)


def objective_spec(name: str) -> ObjectiveSpec:
    """The spec of ``train.objective`` (config checks reject unknown names first)."""
    _load()
    if name not in _SPECS:
        close = difflib.get_close_matches(str(name).lower(), names(), n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"train.objective must be {', '.join(names()[:-1])} or {names()[-1]}, got {name!r}{hint}")
    return _SPECS[name]


def scores_tokens(cfg) -> bool:
    """Is the run's loss nats per vocabulary token (validation perplexity, logits over the vocabulary)? The
    objective's ``token_loss`` and the head's (an objective's own head, or a hash-code head, scores
    something else)."""
    from megahash import catalog

    return objective_spec(cfg.train.objective).token_loss and catalog.caps("head", cfg.model.head).token_loss


def standard() -> str:
    """The default ``train.objective``."""
    _load()
    return next(n for n, s in sorted(_SPECS.items()) if s.standard)
