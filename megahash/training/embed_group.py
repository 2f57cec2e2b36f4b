"""``train.embed_lr`` (issue 44, docs/compact_models.md#levers): the embedding tables in an optimizer group of
their own, at their own peak learning rate (Parameter Golf trains its tied embedding at 0.05 while the rest
runs at a tenth of that [OpenAI26]); the schedule scales it as it scales ``train.lr``
(:class:`megahash.training.lr_schedule.Schedule`, a group's own ``max_lr``).

A table is a 2-D parameter of the model's embedding module (``embedding.*``: vocabulary rows, hash tables and
their projections; with ``model.tie_embeddings`` also the head) or of any other embedding module (a kind
input's token table). They never go to Muon (``muon.routes_to_muon``), so they leave an AdamW group.
"""

from __future__ import annotations

import torch

from megahash.models.mup import is_embedding


def embedding_tables(model: torch.nn.Module) -> list[str]:
    """Names of the trainable 2-D parameters that are embedding tables (module docstring)."""
    out = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.requires_grad and p.ndim >= 2 and (name.startswith("embedding.") or is_embedding(module)):
                out.append(name)
    return out


def with_embed_lr(model: torch.nn.Module, groups: list[dict], lr: float) -> list[dict]:
    """``groups`` with the embedding tables moved into groups of their own (each keeping its weight decay
    and tags) at peak ``lr``; unchanged when ``lr`` is 0 (``train.embed_lr`` off)."""
    if not lr:
        return groups
    params = dict(model.named_parameters())
    tables = {id(params[n]) for n in embedding_tables(model)}
    kept, moved = [], []
    for g in groups:
        took = [p for p in g["params"] if id(p) in tables]
        if took:
            moved.append({**g, "params": took, "lr": lr})
        kept.append({**g, "params": [p for p in g["params"] if id(p) not in tables]})
    return [g for g in kept if g["params"]] + moved
