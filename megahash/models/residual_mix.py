"""Residual mixing with the embedding stream (issue 44, docs/compact_models.md#levers): modded-nanogpt's x0 mixing
and U-Net skips ([Jordan24b] train_gpt.py), learnable scalars around the layer loop.

* ``model.x0_mix``: layer i's input is ``a_i x + b_i x0``, x0 = RMSNorm(embedding output) without a weight
  (modded-nanogpt's ``norm``), ``a_i = 1``, ``b_i = 0`` at init (so the model starts as the plain one);
* ``model.unet_skips``: with n = L // 2, the outputs of layers 0..n-1 are added, each times its own weight
  (1 at init), to the inputs of layers L-1..L-n (the mirrored ones: layer L-n gets layer n-1's, ...). The skip
  is added before the x0 mix, as modded-nanogpt's ``GPT.forward`` adds it before ``Block.forward`` mixes.
  With an odd L the middle layer gets none.

One module (torch only: the Hugging Face export copies it verbatim) that both models run their layers through:
``megatron_model.Block`` and the export's ``reference_layers.Decoder``. The scalars are 1-D parameters
replicated over tensor-parallel ranks (AdamW, no weight decay, as the norms' weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualMix(nn.Module):
    """The learnable scalars of x0 mixing (``resid_lambdas``, ``x0_lambdas`` [L]) and U-Net skips
    (``skip_weights`` [L // 2]); :meth:`run` is the layer loop with them."""

    def __init__(self, num_layers: int, x0_mix: bool, unet_skips: bool, eps: float, dtype=torch.float32):
        super().__init__()
        self.num_layers, self.eps = num_layers, eps
        self.num_skips = num_layers // 2 if unet_skips else 0
        if x0_mix:
            self.resid_lambdas = nn.Parameter(torch.ones(num_layers, dtype=dtype))
            self.x0_lambdas = nn.Parameter(torch.zeros(num_layers, dtype=dtype))
        else:
            self.resid_lambdas = self.x0_lambdas = None
        self.skip_weights = nn.Parameter(torch.ones(self.num_skips, dtype=dtype)) if self.num_skips else None

    def reset_parameters(self) -> None:
        """The initial values (a_i, b_i) = (1, 0), skip weights 1."""
        with torch.no_grad():
            for p, value in ((self.resid_lambdas, 1.0), (self.x0_lambdas, 0.0), (self.skip_weights, 1.0)):
                if p is not None:
                    p.fill_(value)

    def x0(self, emb: torch.Tensor):
        """The embedding stream mixed in: RMSNorm(emb) with no weight, or None without ``model.x0_mix``."""
        return None if self.x0_lambdas is None else F.rms_norm(emb, (emb.shape[-1],), eps=self.eps)

    def run(self, x: torch.Tensor, layer, x0=None) -> torch.Tensor:
        """``layer(i, x) -> x`` for i = 0..L-1 with the skips and the x0 mix on each input; ``x0`` is
        :meth:`x0` of the block's input (default: of ``x``)."""
        if self.x0_lambdas is not None and x0 is None:
            x0 = self.x0(x)
        skips, n, first = [], self.num_skips, self.num_layers - self.num_skips
        for i in range(self.num_layers):
            if n and i >= first:  # U-Net: layer n-1-(i-first)'s output, the last pushed first
                x = x + self.skip_weights[i - first].to(x.dtype) * skips.pop()
            if x0 is not None:
                x = self.resid_lambdas[i].to(x.dtype) * x + self.x0_lambdas[i].to(x.dtype) * x0
            x = layer(i, x)
            if i < n:
                skips.append(x)
        return x


def build(x0_mix: bool, unet_skips: bool, num_layers: int, eps: float, dtype=torch.float32):
    """The model's :class:`ResidualMix` (``model.x0_mix``, ``model.unet_skips``), or None when both are off
    (the layers then run as before)."""
    return ResidualMix(num_layers, x0_mix, unet_skips, eps, dtype) if (x0_mix or unet_skips) else None


def run_layers(residual: ResidualMix | None, num_layers: int, x: torch.Tensor, layer) -> torch.Tensor:
    """``layer(i, x) -> x`` for i = 0..num_layers-1, through ``residual``'s mixing where the model has one."""
    if residual is not None:
        return residual.run(x, layer)
    for i in range(num_layers):
        x = layer(i, x)
    return x
