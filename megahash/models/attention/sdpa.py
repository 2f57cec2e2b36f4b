"""Softmax core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Drop-in for megatron-core's ``DotProductAttention`` (same constructor and forward signature), so
softmax kinds get flash / memory-efficient kernels on GPU and the math kernel on CPU.
softmax(QK^T/sqrt(d_h)) V ([Vaswani17]; [Xue25] eq. 3.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megahash.models.attention import document_mask
from megahash.ops.utils.window import band_mask


@dataclass
class PackedDocuments(PackedSeqParams):
    """megatron-core's ``packed_seq_params`` carrying the packed documents' ids [b, s] to this core: the
    argument megatron-core's own ``SelfAttention`` hands its core per forward (a kind built on it).
    ``qkv_format`` stays None: not megatron's ``thd`` layout, the batch keeps its [s, b] shape."""

    document_ids: torch.Tensor = None


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_kw,
    ):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        kv = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        document_ids=None,
        window=None,
        masks=None,
        **_kw,
    ):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> [sq, b, np*hn]. ``document_ids`` [b, s]
        (packed documents; or those of ``packed_seq_params``, :class:`PackedDocuments`): attention inside each
        document; ``window``: within a sliding window of that many keys (megahash/models/attention/document_mask.py;
        ``masks``: the forward's store of the masks its layers share)."""
        mask_type = attn_mask_type or self.attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if k.shape[1] != q.shape[1]:  # GQA/MQA: repeat the key/value groups
            rep = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if document_ids is None and isinstance(packed_seq_params, PackedDocuments):
            document_ids = packed_seq_params.document_ids
        sq, sk = q.shape[2], k.shape[2]
        window = None if window is None or window >= sk else window  # a window of the whole length: none
        dropout = self.dropout_p if self.training else 0.0
        if (document_ids is not None or window is not None) and sq == sk:
            keep = None if attention_mask is None else ~attention_mask.reshape(attention_mask.shape[0], -1)
            causal = mask_type == AttnMaskType.causal
            out = document_mask.attend(q, k, v, document_ids, causal, keep, self.softmax_scale, dropout, window, masks)
            b, h, s, d = out.shape
            return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        elif mask_type == AttnMaskType.causal and sq != sk:
            # decoding with a cache: query positions are the last sq of sk (and see a window of keys)
            mask = band_mask(sq, sk, window or sk, True, q.device)
            causal = False
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=self.softmax_scale
        )
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
