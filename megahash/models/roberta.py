"""The RoBERTa-base-faithful encoder layout (``model.layout=roberta``; [Xue25] ch. 2-3 encoders).

HashFormers (ch. 2) and MHE (ch. 3) train BERT/RoBERTa-base encoders: post-LN layers, learned
absolute positions, token-type embeddings and a LayerNorm on the embeddings ([Liu19],
transformers' ``RobertaModel``). megahash's other encoder layout (``prenorm``) uses the decoder's
pre-norm blocks with RoPE. With ``roberta``:

- embeddings: e = LayerNorm(Emb(tokens) + P[pos] + T[type]); Emb is any megahash embedding (vocab or
  hash, which keep their own parameters), P has ``max_position_embeddings + 2`` rows and positions
  start at 2 for real tokens (RoBERTa's padding_idx + 1; padding positions use row 1), T has
  ``model.type_vocab_size`` rows (RoBERTa-base: 1; every token has type 0); then hidden dropout.
  Under sequence parallelism P[pos] + T[type] is computed for the whole sequence and scattered to
  the rank's slice (its backward gathers the full gradient); the LayerNorm's gradients are summed
  over TP like every sequence-parallel norm.
- layers (:class:`PostNormLayer`): h = LN_1(h + Attn(h)); h = LN_2(h + MLP(h)) (GELU MLP with
  biases); ``input_layernorm`` is LN_1 (RoBERTa's attention.output.LayerNorm) and
  ``pre_mlp_layernorm`` LN_2 (output.LayerNorm). No final norm, no RoPE: attention kinds see
  positions only through the embeddings, so MHE's head embeddings (eq. 3.5) act on projections of
  position-carrying hidden states, before any positional mixing.

Parameters (vocab embedding, d = hidden, f = FFN, V rows, P positions, T types, L layers):
(V + P + 2 + T) d + 2d + L (4d^2 + 4d + 2 d f + f + d + 4d), RoBERTa-base's count without pooler
(124,055,040 at V = 50,265, P = 512, T = 1; tested against transformers' ``RobertaModel``).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer

from megahash.models.norm import Norm

POSITION_OFFSET = 2  # RoBERTa: padding_idx (1) + 1


class PostNormLayer(TransformerLayer):
    """Post-LN transformer layer (BERT/RoBERTa): residual add, then LayerNorm, after each sublayer."""

    def forward(
        self,
        hidden_states=None,
        attention_mask=None,
        context=None,
        context_mask=None,
        rotary_pos_emb=None,
        inference_context=None,
        **kwargs,
    ):
        attn = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
        )
        with self.bias_dropout_add_exec_handler():
            h = self.self_attn_bda(self.training, self.config.bias_dropout_fusion)(
                attn, hidden_states, self.hidden_dropout
            )
        h = self.input_layernorm(h)
        mlp = self.mlp(h)
        with self.bias_dropout_add_exec_handler():
            out = self.mlp_bda(self.training, self.config.bias_dropout_fusion)(mlp, h, self.hidden_dropout)
        return self.pre_mlp_layernorm(out), context


class RobertaEmbeddingExtras(MegatronModule):
    """P[pos] + T[type], LayerNorm and dropout on top of the token embedding (see module docstring)."""

    def __init__(self, config, cfg):
        super().__init__(config=config)
        m = cfg.model
        h = config.hidden_size
        self.position_embeddings = torch.nn.Embedding(
            m.max_position_embeddings + POSITION_OFFSET, h, dtype=config.params_dtype
        )
        self.token_type_embeddings = torch.nn.Embedding(max(1, m.type_vocab_size), h, dtype=config.params_dtype)
        if config.perform_initialization:
            for emb in (self.position_embeddings, self.token_type_embeddings):
                full = torch.empty(emb.weight.shape, dtype=torch.float)
                config.init_method(full)
                with torch.no_grad():
                    emb.weight.copy_(full.to(config.params_dtype))
        self.layernorm = Norm(config, h, eps=config.layernorm_epsilon)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, emb, padding_mask=None, token_types=None, position_ids=None):
        """emb [s(/tp under SP), b, h]; padding_mask [b, s] (True = real token); position_ids [b, s] (packed
        documents: positions from 0 in each) -> [s(/tp), b, h]."""
        b = emb.shape[1]
        s = emb.shape[0] * (
            parallel_state.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1
        )
        idx = torch.arange(s, device=emb.device).unsqueeze(0).expand(b, s) if position_ids is None else position_ids
        idx = idx + POSITION_OFFSET
        if padding_mask is not None:
            idx = torch.where(padding_mask.bool(), idx, torch.full_like(idx, POSITION_OFFSET - 1))
        types = token_types if token_types is not None else torch.zeros_like(idx)
        extra = (self.position_embeddings(idx) + self.token_type_embeddings(types)).transpose(0, 1).to(emb.dtype)
        if self.config.sequence_parallel:
            extra = tensor_parallel.scatter_to_sequence_parallel_region(
                extra.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
            )
        out = self.layernorm(emb + extra)
        if self.training and self.config.hidden_dropout > 0:
            if self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    return self.dropout(out)
            return self.dropout(out)
        return out


def build_embedding_extras(config, cfg):
    """The embedding extras of the ``roberta`` layout (None for ``prenorm``)."""
    return RobertaEmbeddingExtras(config, cfg) if cfg.model.layout == "roberta" else None
