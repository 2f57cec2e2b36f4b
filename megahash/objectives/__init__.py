"""Training objectives, one file each (causal LM ``clm``, masked LM ``mlm``, Shuffle+Random ``sr``,
[Xue25] sec. 2.3.6), each registering an :class:`~megahash.objective_spec.ObjectiveSpec`. The trainer
calls ``objective.set_step(step, dp_rank)`` before each optimizer step and ``objective.prepare(batch)``
on each micro-batch; corruption randomness comes from a generator seeded by (seed, step, rank), so a
resumed run corrupts exactly as the uninterrupted one. The objective files import torch inside their
functions (config checks read their specs without it).
"""

from __future__ import annotations

import inspect
import sys

from megahash.objective_spec import objective_spec


def _current(fn):
    """``fn`` as its module holds it now (late-bound like a module attribute: a wrapper put there is used)."""
    return None if fn is None else getattr(sys.modules[fn.__module__], fn.__name__)


class Objective:
    def __init__(self, name: str, seed: int, special_ids: dict | None = None):
        import torch

        self.name = name
        self.spec = objective_spec(name)
        self.special_ids = dict(special_ids or {}) or None  # role -> id (None: the word ids 0-4)
        self.seed = seed
        self.generator = torch.Generator()
        self._corrupt = _current(self.spec.corrupt)
        self.options: dict = {}  # extra corrupt() arguments (S+R random replacements, from the config)

    def set_step(self, step: int, rank: int) -> None:
        self.generator.manual_seed((self.seed * 1_000_003 + step * 4099 + rank) % (2**63))

    def prepare(self, batch: dict) -> dict:
        """No corruption (clm): the dataset's shifted labels. Else corrupt the inputs, labels per token."""
        if self._corrupt is None:
            return batch
        docs = {}  # packed documents (data.reset_attention_mask): an objective that takes them (S+R) keeps to them
        if batch.get("document_ids") is not None and "document_ids" in inspect.signature(self._corrupt).parameters:
            docs["document_ids"] = batch["document_ids"]
        out = self._corrupt(
            batch["tokens"],
            batch.get("hash_codes"),
            generator=self.generator,
            special_ids=self.special_ids,
            **self.options,
            **docs,
        )
        return {**batch, **out}


def build_objective(cfg, data=None) -> Objective:
    obj = Objective(cfg.train.objective, cfg.train.seed, getattr(cfg.data, "special_ids", None))
    if obj._corrupt is not None and obj.spec.options is not None:
        obj.options = _current(obj.spec.options)(cfg, getattr(data, "vocab_size", None) or cfg.model.vocab_size or None)
    return obj
