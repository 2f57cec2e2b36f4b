"""The generic hook through which a kind adds an input to the model (e.g. the fixed sequence that
rndembqk/fixedseqqk layers read their Q, K from, [Xue25] eq. 4.9-4.12).

A kind registers ``model_input=build`` (:func:`megahash.models.registry.register_attention`); ``build(model,
cfg)`` returns a :class:`KindInput` or None. The model keeps it as ``model.<attr>`` (so its buffers are
checkpointed and exported under that prefix) and calls it before every pass of the block, where it may hand
its layers what they need through the forward's state (``ForwardState.inputs``); the trainer,
evaluation and diagnostics call :meth:`KindInput.prepare`. Nothing outside the kind's file knows what
the input is.
"""

from __future__ import annotations

import torch


class KindInput(torch.nn.Module):
    """An input a kind adds to the model; every method has a do-nothing default."""

    attr = "kind_input"  # the model attribute (state-dict prefix) it lives under

    def prepare(self, cfg, vocab_size: int | None, texts) -> None:
        """Data-dependent setup before training or evaluation, given the run's config and vocabulary;
        ``texts.token_ids(source, length, vocab_size, key)`` reads a text as token ids
        (:class:`megahash.data.text_source.RunTexts`, or ``RandomTexts`` for synthetic tasks): models
        open no files."""

    def embed(self, tokens, emb, decode_state):
        """Right after the token embedding: ``tokens`` [b, s] (the new ones while decoding), ``emb`` [s(/TP
        under SP), b, h]; returns the embedding, e.g. with a term added. ``decode_state``
        (:class:`megahash.models.megatron_model.DecodeState` or None) keeps what it must carry between
        decoding steps in ``decode_state.inputs``."""
        return emb

    def param_report(self) -> dict:
        """{``embedding_<label>``: global parameter count} for ``megahash params`` (nothing by default)."""
        return {}

    def enter(self, model, state, emb, mask, seq_len: int, rotary):
        """Before the block runs on ``emb`` [s, b, h]: returns (emb, mask), e.g. with one more sequence.
        ``state``: the forward's :class:`megahash.models.forward_state.ForwardState` (``state.offset``,
        ``state.decode``; what the input hands its layers goes to ``state.inputs[self.attr]``).
        ``rotary``: RoPE frequencies of positions offset..offset+seq_len-1 (the batch's own may restart per
        document; rows appended here run at these), None with learned positions."""
        return emb, mask

    def export_meta(self) -> dict:
        """What the Hugging Face reference of the input needs (sizes, its kind), JSON-serialisable."""
        return {}
