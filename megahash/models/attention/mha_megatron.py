"""``mha-megatron``: megatron-core's own ``SelfAttention`` with the SDPA core, as a kind.

Reference only (tests compare megahash's standard attention against it): it keeps no decoding cache,
so incremental decoding with it is not available; no cost model ("measured only", and its
module has no ``mix`` to measure: "n/a"); no Hugging Face export. The model's per-forward state
(``inference_context``, :class:`megahash.models.forward_state.ForwardState`) is not megatron's KV-cache
context, so it is not passed on; its packed documents reach the SDPA core as ``packed_seq_params``.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.maps import softmax_core_maps
from megahash.models.attention.sdpa import PackedDocuments, SDPACoreAttention
from megahash.models.norm import HeadNorm
from megahash.models.registry import AttentionCaps, mask_type, register_attention


class MegatronSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` given the model's forward state: megatron's own attention runs without
    an inference context, the state's document ids going to the core (:class:`PackedDocuments`)."""

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None, **kwargs):
        docs = None if inference_context is None else inference_context.document_ids
        if docs is not None:
            kwargs["packed_seq_params"] = PackedDocuments(document_ids=docs)
        return super().forward(hidden_states, attention_mask, key_value_states, None, **kwargs)


@register_attention(
    "mha-megatron", costs=None, caps=AttentionCaps(decodes=False, exportable=False), maps=softmax_core_maps
)
def mha_megatron_spec(cfg) -> ModuleSpec:
    return ModuleSpec(
        module=MegatronSelfAttention,
        params={"attn_mask_type": mask_type(cfg)},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
            k_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
        ),
    )
