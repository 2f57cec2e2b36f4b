"""``mha-megatron``: megatron-core's own ``SelfAttention`` with the SDPA core, as a kind.

Reference only (tests compare megahash's standard attention against it): it has no ``decode_cache``
support, so incremental decoding with it is not available; no cost model ("measured only", and its
module has no ``mix`` to measure: "n/a"); no Hugging Face export.
"""
from __future__ import annotations

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megahash.models.attention.sdpa import SDPACoreAttention
from megahash.models.norm import HeadNorm
from megahash.models.registry import AttentionCaps, mask_type, register_attention


@register_attention("mha-megatron", costs=None, caps=AttentionCaps(decodes=False, exportable=False))
def mha_megatron_spec(cfg) -> ModuleSpec:
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": mask_type(cfg)},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
            k_layernorm=HeadNorm if cfg.model.qk_norm else IdentityOp,
        ),
    )
