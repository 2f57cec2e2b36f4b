"""The optimizer's parameter groups: which parameters share a learning rate, an Adam epsilon and a weight decay.

Every parameter gets a *role* (:func:`roles`), the parameters of one role are one group, and
:func:`group_settings` is the one place a group's learning rate and epsilon are decided from its role
(``train.lr``/``train.eps`` where it sets none; the LR schedule scales every group's peak alike,
megahash/training/lr_schedule.py):

- ``muon``: the matrices Muon takes (``train.optimizer=muon``, megahash/training/muon.py): ``train.muon.lr``;
- ``hidden``: under muP (``model.mup_base_hidden_size``, megahash/models/mup.py) and AdamW, the hidden matrices:
  ``train.lr`` / m and ``train.eps`` / m (m the model's ``mup_width``; [Yang22] Table 3, Megatron-LM's
  ``get_mup_config_overrides``);
- ``decay``: the other 2-D parameters (embeddings, output layer, heads; under muP also a kind's vector-like ones):
  ``train.lr``, decay ``train.weight_decay``;
- ``no_decay``: 1-D parameters (norms, biases): ``train.lr``, no weight decay (Megatron's rule);
- with ``train.embed_lr``, the embedding tables leave their group for one of their own at that peak LR
  (megahash/training/embed_group.py).

Without muP an AdamW run has the groups ``decay``, ``no_decay`` (the layout of earlier checkpoints' optimizer
state). The first group keeps ``train.lr`` (the logged LR is the first group's).
"""

from __future__ import annotations

import math

import torch

from megahash.models import mup
from megahash.training.embed_group import with_embed_lr

ORDER = ("decay", "no_decay", "hidden", "muon")  # the first group's LR is the one logged: train.lr


def roles(model: torch.nn.Module, muon: bool = False) -> dict[str, str]:
    """Parameter name -> its role (module docstring), for the trainable parameters; ``muon``: Muon takes the
    matrices (muP's hidden matrices under muP, else every 2-D weight of the transformer layers)."""
    width = getattr(model, "mup_width", None)
    matrices = mup.hidden_matrices(model) if width is not None else mup.layer_matrices(model)
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if matrices.get(name) and (muon or width is not None):
            out[name] = "muon" if muon else "hidden"
        else:
            out[name] = "decay" if p.ndim >= 2 else "no_decay"
    return out


def group_settings(role: str, t, width: float | None) -> dict:
    """The learning rate, Adam epsilon and weight decay of a group of ``role`` (module docstring; ``t`` the train
    config, ``width`` muP's m or None): the one place per-group learning rates are decided."""
    m = width or 1.0
    if role == "muon":
        # Muon's update has unit spectral norm times its shape factor: `original` sqrt(max(1, fan_out/fan_in)) is
        # width-independent (the spectral condition [Yang23]); `match_rms_adamw`'s 0.2 sqrt(max(fan_out, fan_in))
        # grows as sqrt(m), which muP takes back
        shape = 1.0 / math.sqrt(m) if t.muon.adjust_lr == "match_rms_adamw" else 1.0
        return {"lr": t.muon.lr * shape, "weight_decay": t.weight_decay}
    if role == "hidden":
        return {"lr": t.lr / m, "eps": t.eps / m, "weight_decay": t.weight_decay}
    return {"weight_decay": t.weight_decay if role == "decay" else 0.0}


def param_groups(model: torch.nn.Module, t, muon: bool = False) -> list[dict]:
    """The groups of the run's optimizer: one per role present, in :data:`ORDER`, each ``{"params": [...],
    **group_settings(role)}``; ``muon``: Muon takes the matrices (its group tagged ``use_muon``, the others not)."""
    by_role: dict[str, list] = {}
    named = dict(model.named_parameters())
    for name, role in roles(model, muon).items():
        by_role.setdefault(role, []).append(named[name])
    width = getattr(model, "mup_width", None)
    groups = []
    for role in ORDER:
        if by_role.get(role):
            group = {"params": by_role[role], **group_settings(role, t, width)}
            if muon:
                group["use_muon"] = role == "muon"
            groups.append(group)
    return with_embed_lr(model, groups, t.embed_lr)  # train.embed_lr: the tables in groups of their own
