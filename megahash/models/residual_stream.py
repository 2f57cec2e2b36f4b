"""Residual-stream levers of compact models (issue 44, docs/compact_models.md#levers), written once for the
megatron-core layer of training (:class:`megahash.models.megatron_model.StreamLayer`) and the plain-torch layer
of the Hugging Face export (``reference_layers.Layer``). Torch-only: ``megahash export-hf`` copies this file.

With x_i the input of layer i (0-based) of L, x0 the block's input (the embedding stream) and E = floor(L / 2):

- ``model.x0_mix``: x_i <- a_i * x_i + b_i * x0, learnable a_i, b_i [h] (init 1 and 0: the plain model at init),
  modded-nanogpt's and Parameter Golf's ``resid_mix`` ([Jordan24b], [OpenAI26]);
- ``model.unet_skips``: the outputs of the first E layers are kept, and layer E + j (j < E) adds
  w_j * (output of layer E - 1 - j) to its input first, learnable w_j [h] (init 1), Parameter Golf's
  ``skip_weights`` (a U-Net over depth; with L odd the last layer takes none).

All vectors are 1-D (AdamW without weight decay, never Muon) and cast to the stream's dtype (bf16 runs keep a
bf16 residual stream). The kept outputs travel in the forward's :class:`megahash.models.mixing.MixState`
(``skips``), so nothing is written onto a module per forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def takes_skip(index: int, num_layers: int) -> bool:
    """Layer ``index`` (0-based) adds a kept output (the second half, paired with the first)."""
    half = num_layers // 2
    return half <= index < 2 * half


def gives_skip(index: int, num_layers: int) -> bool:
    """Layer ``index`` (0-based) keeps its output for a later layer (the first half)."""
    return index < num_layers // 2


class ResidualStream(nn.Module):
    """What one layer does to the residual stream before (:meth:`enter`) and after (:meth:`leave`) itself."""

    def __init__(self, hidden: int, index: int, num_layers: int, x0_mix: bool, unet_skips: bool, dtype=None):
        super().__init__()
        self.gives = unet_skips and gives_skip(index, num_layers)
        if unet_skips and takes_skip(index, num_layers):
            self.skip_weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        if x0_mix:
            self.x_weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
            self.x0_weight = nn.Parameter(torch.zeros(hidden, dtype=dtype))

    @staticmethod
    def wanted(cfg_model) -> bool:
        return bool(cfg_model.x0_mix or cfg_model.unet_skips)

    def enter(self, x: torch.Tensor, state) -> torch.Tensor:
        """The layer's input [s, b, h] from the stream ``x`` (``state``: the forward's MixState)."""
        if getattr(self, "skip_weight", None) is not None:
            x = x + self.skip_weight.to(x.dtype) * state.skips.pop()
        if getattr(self, "x_weight", None) is not None:
            x = self.x_weight.to(x.dtype) * x + self.x0_weight.to(x.dtype) * state.embeddings
        return x

    def leave(self, out: torch.Tensor, state) -> None:
        """Keep the layer's output for its partner layer (U-Net skips)."""
        if self.gives:
            state.skips.append(out)
