"""Shared plumbing of the megahash attention kinds (not a kind itself).

Every kind is a ``MegatronModule`` built by megatron's ``build_module`` for the ``self_attention``
slot of ``TransformerLayer`` and follows its contract::

    forward(hidden_states [s(/tp under SP), b, h], attention_mask=None, inference_context=None,
            rotary_pos_emb=None, ...) -> (output [s(/tp), b, h], bias or None)

Tensor/sequence parallelism: per-head projections are megatron ``ColumnParallelLinear`` (each TP
rank owns ``n/tp`` heads; under SP they all-gather the sequence), the output projection
``linear_proj`` is a ``RowParallelLinear(input_is_parallel=True)`` (reduce-scatter under SP).
Projections that cannot be split by head (the single head of SHA, the shared K/V head of MQA,
the shared seed projections of MHE) are :class:`ReplicatedLinear`: every TP rank holds the full
weight, drawn from the same master tensor as megatron's CPU initialisation (so a seed gives the
same model at any TP size), and its gradient is summed over the TP group by a tensor hook
(each rank only sees the gradient of its own heads), like the sequence-parallel norms.

Per-forward state: ``inference_context`` is the forward's :class:`megahash.models.forward_state.ForwardState`
(the model's inputs, packed documents, the decoding session); a kind's ``mix`` gets it as its last argument.
Incremental decoding: ``state.cache(self.layer_number)`` is the layer's cache dict (None in training);
each kind stores what it needs there (keys/values, recurrent sums, ...).

Parameter naming: everything except ``linear_proj`` is the "qkv" part of a kind
(:meth:`AttentionBase.qkv_parameters`), which is what [Xue25] Table 3.4 counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megahash.errors import ConfigError
from megahash.models.forward_state import ForwardState
from megahash.models.norm import HeadNorm, mark_sequence_parallel, sum_grad_over_tp


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def mark_tp_replicated(params) -> None:
    """Parameters replicated over TP whose ranks see partial gradients: sum the gradients."""
    for p in params:
        p.tp_replicated = True
        sum_grad_over_tp(p)


def master_init(config, *shape) -> torch.Tensor:
    """The full (master) tensor as megatron's CPU initialisation draws it (same RNG stream)."""
    master = torch.empty(*shape, dtype=torch.float)
    config.init_method(master)
    return master.to(config.params_dtype)


def gather_input(x: torch.Tensor, config) -> torch.Tensor:
    """The full-sequence input on every TP rank for projections outside ColumnParallelLinear.

    Under SP: all-gather the sequence (backward: reduce-scatter, i.e. sum of the ranks' partial
    input gradients). Without SP: identity forward, all-reduce backward."""
    if tp_size() == 1:
        return x
    if config.sequence_parallel:
        return tensor_parallel.gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=parallel_state.get_tensor_model_parallel_group()
        )
    return tensor_parallel.copy_to_tensor_model_parallel_region(
        x, group=parallel_state.get_tensor_model_parallel_group()
    )


class ReplicatedLinear(torch.nn.Module):
    """y = x W^T + b with W replicated over TP (full on every rank; gradients summed over TP).

    Call it on the output of :func:`gather_input`."""

    def __init__(self, in_features: int, out_features: int, config, bias: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(master_init(config, out_features, in_features))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=config.params_dtype)) if bias else None
        mark_tp_replicated(self.parameters())

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class PerHeadParameter(MegatronModule):
    """A [heads, dim] parameter split by head over TP (rank r owns heads r*n/tp .. (r+1)*n/tp - 1);
    initialised from the full master tensor with ``config.init_method`` like megatron's layers."""

    def __init__(self, config, heads: int, dim: int):
        super().__init__(config=config)
        tp, r = tp_size(), tp_rank()
        local = heads // tp
        full = master_init(config, heads, dim)
        self.weight = torch.nn.Parameter(full[r * local : (r + 1) * local].clone())
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


def column(in_f: int, out_f: int, config, bias: bool) -> ColumnParallelLinear:
    """Per-head projection split over TP (output rows), sequence gathered under SP."""
    return ColumnParallelLinear(
        in_f,
        out_f,
        config=config,
        init_method=config.init_method,
        bias=bias,
        gather_output=False,
        skip_bias_add=False,
    )


def rope(t: torch.Tensor, rotary_pos_emb, config) -> torch.Tensor:
    """RoPE on [s, b, heads, d] with the (already position-sliced) frequencies of the layer.

    The rotation covers all of d here (rotary_percent 1, not interleaved, unfused): then this is
    megatron-core's ``_apply_rotary_pos_emb_bshd`` term for term, t cos + rotate_half(t) sin (Su et
    al. 2021, eq. 34), bit for bit, without its ``mscale`` products, its ``cat`` of the rotated halves
    and the copy that re-appends an empty pass-through slice: rotate_half(t) sin = roll(t, d/2) sin'
    with sin' the table with its first half negated (megatron's tables repeat the frequencies in both
    halves), so a call is two products, a roll and a sum (backward: two products and a roll). cos and
    sin' are computed once per table (:func:`rope_tables`) and shared by the layers of a forward.
    Other layouts go to megatron-core's ``apply_rotary_pos_emb``."""
    if rotary_pos_emb is None:
        return t
    freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
    if (
        freqs.shape[-1] != t.shape[-1]
        or config.apply_rope_fusion
        or config.rotary_interleaved
        or getattr(config, "multi_latent_attention", False)
        or getattr(config, "context_parallel_size", 1) > 1
    ):
        return apply_rotary_pos_emb(t, freqs, config)
    cos, sin = rope_tables(freqs, t.dtype)
    return t * cos + torch.roll(t, t.shape[-1] // 2, dims=-1) * sin


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated) of a frequency table, in ``dtype``, on the table's device.

    Cached on the table object in eager mode (every layer of one forward gets the same table), computed
    afresh under ``torch.compile`` (where they fuse into the layer's kernels)."""
    cached = None if torch.compiler.is_compiling() else getattr(freqs, "_megahash_rope", None)
    if cached is not None and cached[0] == dtype:
        return cached[1], cached[2]
    cos = torch.cos(freqs).to(dtype)
    sin = torch.sin(freqs).to(dtype)
    sin = torch.cat((-sin[..., : sin.shape[-1] // 2], sin[..., sin.shape[-1] // 2 :]), dim=-1)  # the table only
    if not torch.compiler.is_compiling():
        freqs._megahash_rope = (dtype, cos, sin)
    return cos, sin


def append_cache(cache: dict | None, key: str, t: torch.Tensor) -> torch.Tensor:
    """Concatenate ``t`` ([s, ...]) to ``cache[key]`` along the sequence and store it back."""
    if cache is None:
        return t
    if key in cache:
        t = torch.cat([cache[key], t], dim=0)
    cache[key] = t
    return t


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """[s, b, n*d] -> [s, b, n, d]."""
    return t.view(t.shape[0], t.shape[1], n, t.shape[2] // n)


class AttentionBase(MegatronModule):
    """Common constructor/forward of the attention kinds; subclasses implement :meth:`mix`.

    ``mix(x, attention_mask, rotary_pos_emb, state)`` returns the heads' output [s, b, proj_in/tp] that
    ``linear_proj`` (RowParallelLinear, input split over TP) maps back to the hidden size; ``state`` is the
    forward's :class:`ForwardState` (an empty one when the module runs alone).
    """

    kind = "base"

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, cfg=None, **_kw):
        super().__init__(config=config)
        self.cfg = cfg
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type == AttnMaskType.causal
        self.tp = tp_size()
        self.n = config.num_attention_heads
        self.d_h = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.d_m = config.hidden_size
        if self.n % self.tp:
            raise ConfigError(f"parallel.tensor={self.tp} does not divide model.num_heads={self.n}")
        self.n_local = self.n // self.tp
        self.qkv_bias = bool(config.add_qkv_bias)
        if cfg is not None and cfg.model.qk_norm:  # Qwen3 QK-norm over each head of q and k
            self.build_qk_norm(self.d_h)

    # -- helpers --------------------------------------------------------------------------
    def build_proj(self, in_features: int) -> None:
        self.linear_proj = RowParallelLinear(
            in_features,
            self.d_m,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=self.config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        if self.linear_proj.bias is not None:  # added after the reduce-scatter: partial grads under SP
            mark_sequence_parallel([self.linear_proj.bias], self.config.sequence_parallel)

    def build_qk_norm(self, dim: int) -> None:
        """``model.qk_norm``: ``q_layernorm``/``k_layernorm`` (megatron-core's names) over ``dim``."""
        self.q_layernorm = HeadNorm(self.config, dim, eps=self.config.layernorm_epsilon)
        self.k_layernorm = HeadNorm(self.config, dim, eps=self.config.layernorm_epsilon)

    def norm_qk(self, q, k):
        """QK-norm of per-head q, k [..., d] (identity without ``model.qk_norm``); before RoPE."""
        if getattr(self, "q_layernorm", None) is None:
            return q, k
        return self.q_layernorm(q), self.k_layernorm(k)

    def qkv_parameters(self) -> list[torch.nn.Parameter]:
        """All parameters of the sublayer except the output projection (Table 3.4 counts these)."""
        return [p for name, p in self.named_parameters() if not name.startswith("linear_proj.")]

    def num_qkv_parameters(self) -> int:
        return sum(p.numel() for p in self.qkv_parameters())

    def key_padding(self, attention_mask, b: int):
        """Encoder padding mask [b, 1, 1, s] (True = masked) -> keep mask [b, s] (True = valid), or None."""
        if attention_mask is None:
            return None
        return ~attention_mask.reshape(attention_mask.shape[0], attention_mask.shape[-1]).bool()

    # -- forward --------------------------------------------------------------------------
    def mix(self, x, attention_mask, rotary_pos_emb, state):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        **_kw,
    ):
        state = inference_context if inference_context is not None else ForwardState()
        if (
            self.config.recompute_granularity == "selective"
            and state.recompute
            and self.training
            and torch.is_grad_enabled()
            and state.cache(self.layer_number) is None
        ):
            out = self._recomputed_mix(hidden_states, attention_mask, rotary_pos_emb, state)
        else:
            out = self.mix(hidden_states, attention_mask, rotary_pos_emb, state)
        return self.linear_proj(out)

    def _recomputed_mix(self, x, attention_mask, rotary_pos_emb, state):
        """``train.recompute=selective``: the token mixing (``mix``: projections, scores, kernel) runs
        again in backward instead of keeping its activations (megatron's ``tensor_parallel.checkpoint``,
        RNG states restored), with the forward's state handed back to it (its tensors as the
        recomputation's inputs, so gradients flow through them)."""
        tensors = state.tensors()
        keys = list(tensors)

        def run(x, attention_mask, rotary_pos_emb, *values):
            return self.mix(x, attention_mask, rotary_pos_emb, state.replace(**dict(zip(keys, values))))

        return tensor_parallel.checkpoint(run, False, x, attention_mask, rotary_pos_emb, *tensors.values())
