"""``staticembqk``: Q and K from the static (layer-0) token embeddings ([Xue25] sec. 4.3.5, eq. 4.13).

Q, K = e W^{Q,K}; V = H W^V; e = Emb(t): the attention map depends on the input sequence but not
on the evolving hidden states (the "Current QK" principle is relaxed). ``e`` is the embedding
output the model hands every layer as ``ForwardState.embeddings`` ([s(/tp under SP), b, h],
the same tensor the first layer receives, no norm applied, as in eq. 4.13); RoPE on Q and K;
causal softmax with a KV cache (keys from e, values from H) while decoding.
Packed documents (``ForwardState.document_ids``): the SDPA core attends inside each document
(block-diagonal causal) and RoPE takes the positions within the document (``data.reset_position_ids``),
so Q, K of a document's tokens are those it has alone (docs/attention.md "Packed documents").

Parameters: ``linear_q`` (n*d_h), ``linear_k``, ``linear_v`` (g*d_h each), ``linear_proj``: exactly
the count of ``mha``.

Limitation: the embeddings reach the layer through the forward state, not through the layer's
inputs, so full activation recompute (``train.recompute=full``), which re-runs the layer after the
forward pass has ended and backpropagates from there, cannot replay it; the module refuses that
setting (selective recompute, which takes the state's tensors as its inputs, and none are fine).
"""

from __future__ import annotations

from megahash.errors import ConfigError
from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.separate_qkv import SeparateQKV
from megahash.models.cost_formulas import StandardQKV
from megahash.models.mixing import append_cache, heads
from megahash.models.registry import AttentionCaps, register_attention


class StaticEmbQK(SeparateQKV):
    """Q, K from the layer-0 token embeddings (RoPE), V from the hidden states; causal softmax, KV cache."""

    def build(self, parts):
        if self.setup.recompute == "full":
            raise ConfigError(
                "staticembqk reads the layer-0 embeddings from the forward state, which full activation "
                "recompute cannot replay; use train.recompute=none or selective"
            )
        super().build(parts)
        self.core_attention = parts.core_attention(self)

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        emb = state.embeddings
        if emb is None:
            raise ConfigError(
                "staticembqk needs the layer-0 embeddings in the forward state (run it inside MegahashLM)"
            )
        q, k = self.qk(emb, rotary_pos_emb)
        v = heads(self.linear_v(x), self.g_local)
        cache = state.cache(self.layer_number)
        k = append_cache(cache, "k", k)
        v = append_cache(cache, "v", v)
        with self.dropout_rng("model-parallel-rng"):  # packed documents: block-diagonal (the core's mask)
            return self.core_attention(q, k, v, attention_mask, document_ids=state.document_ids)


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


class StaticEmbQKCosts(StandardQKV):
    """[Xue25] Tables 4.5-4.8, StaticEmbQK row (= Standard: prefill 4BL^2d + 6BLd^2, decode
    6Bd^2 + 4BLd, activations (8BLd + 2BL^2h)/t, cache 4BLd bytes); cache 2BLgd_h numbers."""

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * L * d + B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        return 4 * B * L * L * d + 6 * B * L * d * d if phase == "prefill" else 6 * B * d * d + 4 * B * L * d

    @staticmethod
    def activation_bytes(B, L, d, h, t=1):
        return (8 * B * L * d + 2 * B * L * L * h) / t

    @staticmethod
    def cache_bytes(B, L, d, h, g=None):
        return 4 * B * L * d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, **_):
        return 2 * B * L * g * d_h


register_attention(
    "staticembqk",
    StaticEmbQK,
    costs=StaticEmbQKCosts,
    caps=AttentionCaps(thesis_name="StaticEmbQK", chapters=(4,)),
    maps=softmax_core_maps,
)
