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

from dataclasses import dataclass

from megatron.core.inference.contexts import BaseInferenceContext

from megahash.models.mixing import MixState


@dataclass(eq=False)
class ForwardState(MixState, BaseInferenceContext):
    """What one pass of the block hands its layers (:class:`megahash.models.mixing.MixState`, the fields the
    kinds read), as a megatron-core ``BaseInferenceContext`` (static batching, decode-only past the prompt)
    so megatron's own layer code accepts it; megatron-core's own attention must not take it for its KV-cache
    context (a kind built on it does not pass the state on)."""

    materialize_only_last_token_logits: bool = False  # BaseInferenceContext's field (megahash: all logits)

    def is_static_batching(self) -> bool:
        return True

    def is_decode_only(self) -> bool:
        return self.decode is not None and self.offset > 0
