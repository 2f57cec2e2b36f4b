"""Maximal-update parametrization (muP) of the model: ``model.mup_base_hidden_size`` = B > 0 ([Yang22];
as Megatron-LM's muP, megatron-core's ``use_mup``, does it, and Microsoft's ``mup`` package).

The width multiplier is m = ``model.hidden_size`` / B: the *base model* is this config at hidden size B (the
proxy a learning rate is tuned on), and the muP model at any width keeps every layer's activations and their
change per step at the base model's scale, so the base model's learning rates (and initialisation) hold
(docs/compact_models.md, "Hyperparameter transfer (muP)"). With H = the *hidden matrices* (:func:`hidden_matrices`:
the 2-D weights of the transformer layers whose two dimensions grow with the width) and everything else
*vector-like* (one dimension or none grows: the embeddings of every kind and the inputs a kind adds, the output
layer and the heads, norms, biases, a kind's per-head vectors):

- H, initialisation: std / sqrt(m), output projections std / sqrt(2 L m) (:func:`scale_init`); vector-like:
  unchanged (``model.init_std``);
- H under AdamW: LR / m and Adam eps / m ([Yang22] Table 3, Megatron's); under Muon: Muon's own shape scaling,
  which is already the spectral condition of [Yang23] (update norm ~ sqrt(fan_out / fan_in)), times 1/sqrt(m) for
  ``train.muon.adjust_lr=match_rms_adamw`` (whose 0.2 sqrt(max(fan_out, fan_in)) grows with the width);
  vector-like: ``train.lr`` (megahash/training/param_groups.py);
- the head's input times B / hidden_size (``mup.MuReadout``; Megatron's logits x 1/m), in
  ``MegahashLM.hidden_states`` (:func:`megahash.models.mixing.readout_multiplier`);
- attention scores sqrt(d_0) q.k / d_h instead of q.k / sqrt(d_h), d_0 = d_h / m the base model's head dim
  (:func:`megahash.models.mixing.score_scale`; each kind: docs/compact_models.md).

At m = 1 the muP model is the standard one, bit for bit (the base model is what a learning rate is tuned on). This module is the model side (which
parameters are hidden, their initialisation); the optimizer side reads :func:`hidden_matrices` and the model's
``mup_width`` (m, None without muP).
"""

from __future__ import annotations

import math

import torch


def width_mult(model_cfg) -> float | None:
    """m = hidden_size / mup_base_hidden_size; None when muP is off (base 0)."""
    base = int(getattr(model_cfg, "mup_base_hidden_size", 0) or 0)
    return model_cfg.hidden_size / base if base else None


def is_embedding(module) -> bool:
    """A lookup table module (torch's or megatron's ``VocabParallelEmbedding``, a hash table)."""
    return isinstance(module, torch.nn.Embedding) or "Embedding" in type(module).__name__


def layer_matrices(model: torch.nn.Module) -> dict[str, bool]:
    """Parameter name -> True for a 2-D weight of a module inside a transformer layer (``decoder.layers``) that is
    not an embedding table: the attention and MLP projections; False for everything else. By role, before any
    ZeRO flattening."""
    out = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            out[name] = (
                p.requires_grad and p.ndim == 2 and name.startswith("decoder.layers.") and not is_embedding(module)
            )
    return out


def hidden_matrices(model: torch.nn.Module) -> dict[str, bool]:
    """Parameter name -> True for muP's hidden matrices: :func:`layer_matrices` but for the parameters a kind marks
    ``vector_like`` (one dimension grows with the width, e.g. MHE's per-head embeddings [heads, d_h])."""
    named = dict(model.named_parameters())
    return {n: r and not getattr(named[n], "vector_like", False) for n, r in layer_matrices(model).items()}


@torch.no_grad()
def scale_init(model: torch.nn.Module, m: float) -> None:
    """Initialise the hidden matrices at muP's scale: each drawn N(0, std^2) (output projections N(0, std^2 / 2L),
    megatron's ``scaled_init_method_normal``) is multiplied by 1/sqrt(m) (megatron-core's ``use_mup``: std /
    sqrt(width_mult), and std / sqrt(2 L width_mult) for the output projections). The same draws as without
    muP, scaled: every TP shard of a matrix is scaled alike, so the model does not depend on the TP size."""
    if m == 1.0:
        return
    named = dict(model.named_parameters())
    for name, hidden in hidden_matrices(model).items():
        p = named[name]
        if hidden and not p.is_meta:
            p.mul_(1.0 / math.sqrt(m))
