"""The megatron-core side of every attention kind: its parts and its layer (not a kind itself).

A kind is written once (:class:`megahash.models.mixing.Mixing`); :func:`megatron_layer` derives the module
megatron's ``build_module`` builds for the ``self_attention`` slot of ``TransformerLayer``, with its contract::

    forward(hidden_states [s(/tp under SP), b, h], attention_mask=None, inference_context=None,
            rotary_pos_emb=None, ...) -> (output [s(/tp), b, h], bias or None)

Tensor/sequence parallelism (:class:`MegatronParts`): per-head projections are megatron ``ColumnParallelLinear``
(each TP rank owns ``n/tp`` heads; under SP they all-gather the sequence), the output projection
``linear_proj`` is a ``RowParallelLinear(input_is_parallel=True)`` (reduce-scatter under SP). Projections
that cannot be split by head (the single head of SHA, the shared K/V head of MQA, the shared seed
projections of MHE) are :class:`ReplicatedLinear`: every TP rank holds the full weight, drawn from the same
master tensor as megatron's CPU initialisation (so a seed gives the same model at any TP size), and its
gradient is summed over the TP group by a tensor hook (each rank only sees the gradient of its own heads),
like the sequence-parallel norms.

Per-forward state: ``inference_context`` is the forward's :class:`megahash.models.forward_state.ForwardState`
(the model's inputs, packed documents, the decoding session); the kind's ``mix`` gets it as its last argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megahash.models import autocast_linear
from megahash.models.attention.sdpa import SDPACoreAttention
from megahash.models.forward_state import ForwardState
from megahash.models.mixing import Setup
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
    """y = x W^T + b with W replicated over TP (full on every rank; gradients summed over TP), on the input
    gathered over TP (:func:`gather_input`)."""

    def __init__(self, in_features: int, out_features: int, config, bias: bool):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(master_init(config, out_features, in_features))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=config.params_dtype)) if bias else None
        mark_tp_replicated(self.parameters())

    def forward(self, x):
        return F.linear(gather_input(x, self.config), self.weight, self.bias)


class PerHeadParameter(MegatronModule):
    """A [heads, dim] parameter split by head over TP (rank r owns heads r*n/tp .. (r+1)*n/tp - 1);
    initialised from the full master tensor with ``config.init_method`` like megatron's layers, or with
    ``init(master)`` (in place, fp32, the same draw on every rank: the weights do not depend on the TP size).
    ``flat``: stored as one vector [heads * dim], head-major (a 1-D parameter: no weight decay and no Muon,
    megatron's rule for biases and gains). Vector-like under muP (one dimension grows with the width: per-head
    vectors, not a hidden matrix; megahash/models/mup.py)."""

    def __init__(self, config, heads: int, dim: int, init=None, flat: bool = False):
        super().__init__(config=config)
        tp, r = tp_size(), tp_rank()
        local = heads // tp
        if init is None:
            full = master_init(config, heads, dim)
        else:
            full = torch.empty(heads, dim, dtype=torch.float)
            init(full)
            full = full.to(config.params_dtype)
        full = full[r * local : (r + 1) * local]
        self.weight = torch.nn.Parameter((full.reshape(-1) if flat else full).clone())
        tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        self.weight.vector_like = True

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class Column(ColumnParallelLinear):
    """A per-head projection split over TP (output rows; sequence gathered under SP); returns the output only."""

    def forward(self, x):
        return super().forward(x)[0]


class MegatronParts:
    """The builders a kind declares its projections against (:mod:`megahash.models.mixing`), megatron's."""

    def __init__(self, config):
        self.config = config

    def column(self, in_f: int, out_f: int, bias: bool):
        c = self.config
        return Column(in_f, out_f, config=c, init_method=c.init_method, bias=bias, gather_output=False)

    def replicated(self, in_f: int, out_f: int, bias: bool):
        return ReplicatedLinear(in_f, out_f, self.config, bias)

    def per_head(self, heads: int, dim: int, init=None, flat: bool = False):
        return PerHeadParameter(self.config, heads, dim, init, flat)

    def norm(self, dim: int):
        return HeadNorm(self.config, dim, eps=self.config.layernorm_epsilon)

    def core_attention(self, layer):
        return SDPACoreAttention(
            self.config, layer.layer_number, layer.attn_mask_type, softmax_scale=layer.score_scale()
        )

    def row(self, in_f: int, out_f: int):
        c = self.config
        proj = RowParallelLinear(
            in_f,
            out_f,
            config=c,
            init_method=c.output_layer_init_method,
            bias=c.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        if proj.bias is not None:  # added after the reduce-scatter: partial grads under SP
            mark_sequence_parallel([proj.bias], c.sequence_parallel)
        return proj

    def gather(self, x):
        return gather_input(x, self.config)

    def rng(self, name: str = "model-parallel-rng"):
        return tensor_parallel.get_cuda_rng_tracker().fork(name)


class MegatronLayer(MegatronModule):
    """The megatron-core module of a kind (``megatron_layer(Kind)`` puts it before the kind's class): built by
    ``build_module`` with the ``ModuleSpec`` params the registry gives (``cfg``, the registered ``kind`` name,
    its key/value ``groups``, the layer's own ``options`` from the schedule); ``forward`` is megatron's contract around the kind's ``mix``, whose output
    ``linear_proj`` maps back to the hidden size."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        cfg=None,
        kind=None,
        groups=None,
        options=None,
        **_,
    ):
        super().__init__(config=config)
        kind_options = None if cfg is None else cfg.model.attention.options
        if options:  # the layer's own (a schedule's KIND+OPTION=VALUE) over model.attention.options
            kind_options = {**(kind_options or {}), **options}
        self.cfg, self.attn_mask_type = cfg, attn_mask_type
        n = config.num_attention_heads
        setup = Setup(
            kind=kind or self.kind,
            layer_number=layer_number,
            hidden=config.hidden_size,
            heads=n,
            head_dim=config.kv_channels or config.hidden_size // n,
            groups=groups or config.num_query_groups or n,
            causal=attn_mask_type == AttnMaskType.causal,
            qkv_bias=bool(config.add_qkv_bias),
            qk_norm=cfg is not None and bool(cfg.model.qk_norm),
            qk_gain=0.0 if cfg is None else float(cfg.model.qk_gain),
            tp=tp_size(),
            tp_rank=tp_rank(),
            sequence_parallel=bool(config.sequence_parallel),
            attention_dropout=config.attention_dropout,
            recompute=config.recompute_granularity,
            options=kind_options,
            mup_base=0 if cfg is None else cfg.model.mup_base_hidden_size,
        )
        self.assemble(setup, MegatronParts(config))

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

        run = autocast_linear.keep_autocast(run, x.device.type)  # the recomputation in the forward's autocast
        return tensor_parallel.checkpoint(run, False, x, attention_mask, rotary_pos_emb, *tensors.values())


_LAYERS: dict = {}


def megatron_layer(kind_class: type) -> type:
    """The megatron-core module class of a kind (:class:`MegatronLayer` first, then the kind's class)."""
    if kind_class not in _LAYERS:
        _LAYERS[kind_class] = type(
            kind_class.__name__, (MegatronLayer, kind_class), {"__module__": kind_class.__module__}
        )
    return _LAYERS[kind_class]
