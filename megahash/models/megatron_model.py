"""The megahash language model: decoder (Qwen2.5-style) or encoder (BERT-style) on megatron-core parts.

Built from megatron-core's ``TransformerBlock`` (per-layer specs from the registry),
``RotaryEmbedding``, ``VocabParallelEmbedding``/hash embeddings and a ``ColumnParallelLinear``
LM head with vocab-parallel cross-entropy. We do not subclass ``GPTModel``: it hard-codes its
embedding and its inference path, while megahash needs pluggable embeddings that read
``hash_codes`` from the batch, encoder masks, and its own decoding caches per attention kind.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.activations import squared_relu
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import init_method_normal, make_viewless_tensor, scaled_init_method_normal

from megahash.errors import ConfigError
from megahash.models import autocast_linear, cpu_linear, heads, mup, registry, residual_mix, value_embeds
from megahash.models.arch import arch_of
from megahash.models.cost_formulas import padded_vocab_size
from megahash.models.forward_state import ForwardState
from megahash.models.mixing import readout_multiplier, score_scale
from megahash.models.norm import hook_sequence_parallel_params, mark_sequence_parallel, sum_grad_over_tp


def transformer_config(cfg, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """megatron-core TransformerConfig of a megahash config (RMSNorm + SwiGLU for the decoder)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    arch = arch_of(m.arch)
    recompute = {"none": None, "selective": "selective", "full": "full"}[t.recompute]
    relu2 = m.mlp_activation == "relu2"  # model.mlp_activation: ReLU squared ([So21] Primer), two bias-free matrices
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_heads,
        num_query_groups=m.num_query_groups or m.num_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.hidden_size // m.num_heads,
        # muP (model.mup_base_hidden_size): sqrt(d_0)/d_h, for megatron's own SelfAttention (mha-megatron); the
        # kinds written once take Setup.mup_base
        softmax_scale=(
            score_scale(m.hidden_size // m.num_heads, m.mup_base_hidden_size / m.num_heads)
            if m.mup_base_hidden_size
            else None
        ),
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        normalization="RMSNorm" if arch.rms_norm else "LayerNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=arch.swiglu and not relu2,
        activation_func=squared_relu if relu2 else F.silu if arch.swiglu else F.gelu,
        add_bias_linear=not (arch.swiglu or relu2),
        add_qkv_bias=m.qkv_bias,
        qk_layernorm=m.qk_norm,
        tensor_model_parallel_size=p.tensor,
        sequence_parallel=p.sequence,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=m.init_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``model.logit_softcap``: cap tanh(logits / cap) (Gemma 2 [Gemma24], modded-nanogpt); identity at 0."""
    return logits if not cap else cap * torch.tanh(logits / cap)


def zero_output_projections(layers) -> None:
    """``model.zero_init_proj``: each layer's attention and MLP output projections (``linear_proj``,
    ``linear_fc2``: whatever a kind names so) start at zero, so every residual branch adds nothing at step 0."""
    with torch.no_grad():
        for layer in layers:
            for name, module in layer.named_modules():
                if name.rsplit(".", 1)[-1] in ("linear_proj", "linear_fc2"):
                    for p in module.parameters(recurse=False):
                        p.zero_()


class Rotary(RotaryEmbedding):
    """megatron-core's ``RotaryEmbedding`` with its table on the module's own device.

    megatron moves ``inv_freq`` (a plain attribute, not a buffer) to ``torch.cuda.current_device()``
    whenever it finds it on the CPU, so on a GPU machine a model kept on the CPU (the export check,
    evaluation, indicators) got CUDA tables against CPU activations ("Expected all tensors to be on
    the same device", issue 25). Here an empty non-persistent buffer follows ``.to(device)`` with the
    model, and the table is built on its device (the one the accelerator module moved the model to);
    one cached table per (length, offset, device) instead of megatron's ``lru_cache``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("anchor", torch.empty(0), persistent=False)
        self._table = (None, None)

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.inv_freq.device != self.anchor.device:
            self.inv_freq = self.inv_freq.to(self.anchor.device)
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]  # [s, 1, 1, d]

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        key = (max_seq_len, offset, self.anchor.device)
        if self._table[0] != key:
            self._table = (key, self.get_emb(max_seq_len, offset))
        return self._table[1]


class Block(TransformerBlock):
    """megatron-core's ``TransformerBlock`` whose layers get the forward's :class:`ForwardState` (its
    ``inference_context``) under full activation recompute too, and that runs its layers through the
    residual mixing of ``model.x0_mix`` / ``model.unet_skips`` (``residual``, :mod:`megahash.models.residual_mix`).

    megatron-core 0.16's ``_checkpointed_forward`` hands its layers ``inference_context=None`` (it never
    trains with one), so in training with ``recompute_granularity="full"`` the layers run here under
    ``tensor_parallel.checkpoint`` one by one as megatron's ``uniform`` method does with the
    ``recompute_num_layers=1`` :func:`transformer_config` sets (the same RNG handling, the recomputation in
    backward), each given the state; a state with ``recompute=False`` (a kind input's plain pass) runs them
    without checkpoints. With neither, everything is megatron-core's forward."""

    def __init__(self, *args, residual=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.residual = residual  # ResidualMix or None

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None, inference_context=None, **kwargs):
        state = inference_context
        full = self.training and self.config.recompute_granularity == "full" and state is not None
        if not full and self.residual is None:
            return super().forward(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                inference_context=state,
                **kwargs,
            )
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng:
            hidden_states = self._run_layers(hidden_states, attention_mask, rotary_pos_emb, state, full)
        if self.final_layernorm is not None:
            hidden_states = make_viewless_tensor(
                inp=self.final_layernorm(hidden_states), requires_grad=True, keep_graph=True
            )
        return hidden_states

    def _run_layers(self, hidden_states, attention_mask, rotary_pos_emb, state, full: bool):
        checkpointed = full and state.recompute

        def one(h, mask, rotary, layer):
            return layer(hidden_states=h, attention_mask=mask, rotary_pos_emb=rotary, inference_context=state)[0]

        def run(i, h):
            if checkpointed:
                fn = autocast_linear.keep_autocast(partial(one, layer=self.layers[i]), h.device.type)
                return tensor_parallel.checkpoint(
                    fn, self.config.distribute_saved_activations, h, attention_mask, rotary_pos_emb
                )
            return one(h, attention_mask, rotary_pos_emb, self.layers[i])

        return residual_mix.run_layers(self.residual, len(self.layers), hidden_states, run)


class MegahashLM(MegatronModule):
    """Embedding -> TransformerBlock -> final norm (in the block) -> LM head.

    forward(tokens [b, s], hash_codes [b, s, w] or None, labels [b, s] or None, padding_mask [b, s])
    returns the per-token loss [b, s] when labels are given, else logits [b, s, V/TP] (vocab-parallel).
    """

    def __init__(self, cfg, vocab_size: int, dtype: torch.dtype = torch.float32, init: bool = True):
        config = transformer_config(cfg, dtype)
        config.perform_initialization = init
        super().__init__(config=config)
        self.cfg = cfg
        m = cfg.model
        self.vocab_size = vocab_size
        self.arch = arch_of(m.arch)  # what model.arch is (megahash.models.arch)
        self.decoder_only = self.arch.causal
        if m.embedding not in registry.names("embedding"):
            raise ConfigError(
                f"unknown model.embedding {m.embedding!r} (known: {', '.join(registry.names('embedding'))})"
            )
        # model.embed_init_std: the embedding tables (and so the tied head) drawn at their own std (issue 44)
        config.init_method = init_method_normal(m.embed_init_std or m.init_std)
        self.embedding = registry.spec("embedding", m.embedding).build(config, cfg, vocab_size)
        config.init_method = init_method_normal(m.init_std)
        config.output_layer_init_method = scaled_init_method_normal(m.init_std, m.num_layers)
        from megahash.models import roberta

        self.embedding_extras = roberta.build_embedding_extras(config, cfg)  # layout=roberta: positions, types, LN
        self.layer_kinds = registry.schedule_kinds(cfg)
        self.rotary_pos_emb = Rotary(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_base=m.rotary_base,
            use_cpu_initialization=True,
        )
        # model.x0_mix / model.unet_skips: learnable scalars around the layer loop ([Jordan24b] modded-nanogpt)
        residual = residual_mix.build(m.x0_mix, m.unet_skips, m.num_layers, m.norm_eps, dtype)
        if residual is not None:  # replicated over TP ranks whose inputs are sequence-split under SP
            mark_sequence_parallel(residual.parameters(), cfg.parallel.sequence)
        self.decoder = Block(config=config, spec=registry.block_spec(cfg), residual=residual)
        self.kind_input_attrs = []  # inputs the layer kinds add (megahash.models.kind_input), as model.<attr>
        for build in registry.model_inputs(self.layer_kinds):
            extra = build(self, cfg)
            if extra is not None:
                setattr(self, extra.attr, extra)
                self.kind_input_attrs.append(extra.attr)
        self.tie = m.tie_embeddings and getattr(self.embedding, "tieable", False)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
            skip_weight_param_allocation=self.tie,
        )
        self.head = heads.build_head(cfg, config, vocab_size)  # train.objective x model.head (models/heads/)
        if not self.head.uses_output_layer:
            self.output_layer = None  # S+R / hash-code heads replace the vocabulary projection
        # model.value_embeds: token tables added to the values of the first and last layers ([Jordan24b]); whole on
        # every TP rank, each adding its value heads' columns, so their gradients are summed over TP
        self.value_embeds = value_embeds.build(
            m.value_embeds,
            [getattr(layer, "self_attention", None) for layer in self.decoder.layers],
            vocab_size,
            m.embed_init_std or m.init_std,
            dtype,
        )
        for p in self.value_embeds.parameters() if self.value_embeds is not None else ():
            sum_grad_over_tp(p)
        if m.zero_init_proj and init:  # every layer starts as the identity ([Jordan24b] modded-nanogpt, issue 44)
            zero_output_projections(self.decoder.layers)
        self.logit_softcap = float(m.logit_softcap)
        self.mup_width = mup.width_mult(m)  # muP's width multiplier m (None: off; megahash/models/mup.py)
        self.readout_mult = readout_multiplier(m.hidden_size, m.mup_base_hidden_size)
        if self.mup_width is not None and init:
            mup.scale_init(self, self.mup_width)  # the hidden matrices at std / sqrt(m)
        hook_sequence_parallel_params(self)  # e.g. RowParallelLinear biases under SP
        cpu_linear.install(self)  # oneDNN GEMMs for the linear layers on CPU (accelerator.policy.onednn_linear)
        autocast_linear.install(self)  # bf16 runs: fp32 parameters, linear layers in the autocast dtype

    def kind_inputs(self) -> list:
        """The inputs the layer kinds added (:class:`megahash.models.kind_input.KindInput`)."""
        return [getattr(self, a) for a in self.kind_input_attrs]

    def attention_modules(self):
        """The ``self_attention`` module of every layer, in layer order."""
        return [layer.self_attention for layer in self.decoder.layers]

    def hidden_states(
        self, tokens, hash_codes=None, padding_mask=None, decode_state=None, document_ids=None, position_ids=None
    ):
        """[b, s] tokens -> final hidden states [s(/TP under SP), b, h], the heads' input (under muP times the
        readout multiplier B / hidden_size, ``mup.MuReadout``'s: megahash/models/mup.py).

        With ``decode_state`` (incremental decoding), ``tokens`` are the new tokens only; their
        positions start at ``decode_state.offset`` and every attention kind reads/extends its cache.
        Packed documents (megahash/data/documents.py): ``document_ids`` [b, s] keep attention inside each
        document (``ForwardState.document_ids``), ``position_ids`` [b, s] restart RoPE / learned positions.
        Every layer gets this forward's :class:`ForwardState` as its ``inference_context``.
        """
        emb = self.embedding(tokens, hash_codes)
        for extra in self.kind_inputs():  # e.g. a token n-gram table added to the embedding
            emb = extra.embed(tokens, emb, decode_state)
        seq_len = tokens.shape[1]
        offset = decode_state.offset if decode_state is not None else 0
        rotary = plain = self.rotary_pos_emb(offset + seq_len)[offset:]
        if position_ids is not None:  # per-token positions: [s, b, 1, d] rows of the table
            rotary = self.rotary_pos_emb(seq_len)[:, 0, 0][position_ids.t()].unsqueeze(2)
        if self.embedding_extras is not None:  # learned absolute positions instead of RoPE
            emb, rotary, plain = self.embedding_extras(emb, padding_mask, position_ids=position_ids), None, None
        mask = None
        if not self.decoder_only:
            pm = padding_mask if padding_mask is not None else torch.ones_like(tokens, dtype=torch.bool)
            mask = ~pm[:, None, None, :].bool()  # megatron: True = masked out, [b, 1, 1, s]
        batch = emb.shape[1]
        state = ForwardState(
            offset=offset, tokens=tokens, document_ids=document_ids, position_ids=position_ids, decode=decode_state
        )
        state.value_embeds = self.value_embeds  # model.value_embeds: the tables the fed layers add to their values
        for extra in self.kind_inputs():  # e.g. a fixed sequence run with (or before) the batch
            emb, mask = extra.enter(self, state, emb, mask, seq_len, plain)
        if rotary is not plain and emb.shape[1] > batch:  # rows a kind input added run at positions offset..
            rotary = torch.cat([rotary, plain.expand(-1, emb.shape[1] - batch, -1, -1)], dim=1)
        emb = autocast_linear.cast_for_autocast(emb, emb.device.type)  # bf16 runs: a bf16 residual stream
        state.embeddings = emb
        out = self.decoder(hidden_states=emb, attention_mask=mask, rotary_pos_emb=rotary, inference_context=state)
        if decode_state is not None:
            decode_state.offset += seq_len
        if out.shape[1] != batch:
            out = out[:, :batch].contiguous()  # drop the sequences the kind inputs added
        if self.readout_mult != 1.0:
            out = out * self.readout_mult
        return out

    def logits(self, hidden):
        weight = self.embedding.weight if self.tie else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return softcap(logits, self.logit_softcap)  # [s, b, V/TP]

    def output_weight(self) -> torch.Tensor:
        """The LM head's weight [V/TP, h] (the embedding's when tied)."""
        return self.embedding.weight if self.tie else self.output_layer.weight

    def forward(
        self,
        tokens,
        hash_codes=None,
        labels=None,
        padding_mask=None,
        decode_state=None,
        label_codes=None,
        document_ids=None,
        position_ids=None,
    ):
        """Per-token loss [b, s] of the head (0 where labels < 0) when labels are given, else the
        head's logits [b, s, ...]; ``label_codes`` [b, s, w] are the targets of hash-code heads;
        ``document_ids``/``position_ids``: packed documents (:meth:`hidden_states`)."""
        hidden = self.hidden_states(tokens, hash_codes, padding_mask, decode_state, document_ids, position_ids)
        return self.head(self, hidden, labels, label_codes=label_codes, hash_codes=hash_codes)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, s, V/TP] vocab-parallel logits -> full [b, s, V] on every TP rank."""
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return logits
        return tensor_parallel.gather_from_tensor_model_parallel_region(
            logits, group=parallel_state.get_tensor_model_parallel_group()
        )


class DecodeState:
    """Incremental-decoding state: the position offset and one cache dict per layer
    (each attention kind stores what it needs there: keys/values, recurrent sums, cached maps)."""

    def __init__(self, num_layers: int):
        self.offset = 0
        self.caches = [dict() for _ in range(num_layers)]
        self.inputs: dict = {}  # what the model inputs carry between steps (KindInput.embed), by their attr

    def layer(self, i: int) -> dict:
        return self.caches[i]


def build_model(cfg, vocab_size: int, dtype: torch.dtype = torch.float32, init: bool = True) -> MegahashLM:
    """Build the model of a config with the vocabulary padded for TP (call after init_distributed).
    ``init=False`` skips weight initialisation (meta-device accounting, loading a checkpoint)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    return MegahashLM(cfg, padded, dtype, init)
