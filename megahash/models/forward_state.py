"""The state of one forward pass, handed to every layer as megatron-core's ``inference_context`` argument.

``MegahashLM.hidden_states`` makes one :class:`ForwardState` per forward and passes it to the
``TransformerBlock``; megatron-core hands it to every layer's ``self_attention``
(``megatron_model.Block`` also under full activation recompute, where megatron-core 0.16 passes None).
The attention kinds read it from that argument (``mix(x, attention_mask, rotary_pos_emb, state)``);
nothing is written onto a module per forward. What lives longer than a forward stays where it was:
the decoding session's caches in :class:`megahash.models.megatron_model.DecodeState` (``decode``),
frozen maps in the kind input that froze them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.inference.contexts import BaseInferenceContext


@dataclass(eq=False)
class ForwardState(BaseInferenceContext):
    """What one pass of the block hands its layers (all optional: a module run alone gets ``ForwardState()``).

    A megatron-core ``BaseInferenceContext`` (static batching, decode-only past the prompt) so megatron's own
    layer code accepts it; megatron-core's own attention must not take it for its KV-cache context
    (a kind built on it does not pass the state on)."""

    embeddings: torch.Tensor | None = None  # the block's input [s(/tp under SP), b, h] (Q, K of eq. 4.13)
    offset: int = 0  # position of the first token (> 0 while decoding)
    tokens: torch.Tensor | None = None  # [b, s], the new tokens only while decoding
    document_ids: torch.Tensor | None = None  # [b, s] packed documents (megahash/data/documents.py) or None
    position_ids: torch.Tensor | None = None  # [b, s] positions within each document or None
    decode: Any = None  # the DecodeState of a decoding session (its per-layer caches), None in training
    inputs: dict = field(default_factory=dict)  # what the model's kind inputs hand their layers, by input attr
    capture: dict | None = None  # a kind input's own pass: its layers record into it, by layer number
    recompute: bool = True  # False: this pass runs without activation recompute (a kind input's plain pass)
    materialize_only_last_token_logits: bool = False  # BaseInferenceContext's field (megahash: all logits)

    def cache(self, layer_number: int) -> dict | None:
        """The decoding cache of a layer (megatron's 1-based ``layer_number``); None when not decoding."""
        return None if self.decode is None else self.decode.layer(layer_number - 1)

    def tensors(self) -> dict:
        """{field: tensor} of the tensor fields set (what a recomputation takes as its inputs)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if torch.is_tensor(getattr(self, f.name))
        }

    def replace(self, **changes) -> ForwardState:
        """A copy with some fields replaced (the dicts are shared)."""
        return dataclasses.replace(self, **changes)

    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return self.decode is not None and self.offset > 0
