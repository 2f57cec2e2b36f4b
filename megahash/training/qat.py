"""``train.qat_bits`` / ``train.qat_fraction``: quantization-aware training for the last fraction of steps.

From step ``round((1 - qat_fraction) * train.steps)`` on, every micro-batch's forward and backward run
with the hidden matrices (the decoder's parameters that ``megahash export`` quantizes: floating, 2-D or
more, above ``KEEP_NUMEL`` elements; megahash/models/quantized.py) replaced by their artifact round trip
``q(w)`` (per-row symmetric, fp16 scale: exactly what the artifact will hold at TP=1), and the gradient
computed there is applied to the live weights w: the straight-through estimator, dq/dw := 1
(Bengio et al. 2013; what ``torch.fake_quantize_per_channel_affine`` does for unclipped values, and no
value clips under this rule). The swap is of the parameters' storage (``p.data``) around forward and
backward, restored before the optimizer step, so the parameter names, the optimizer and checkpoints are
unchanged. Embeddings and the output head train unquantized (the artifact still quantizes them).
Under TP > 1 a row-parallel shard is scaled by its own rows' part (slightly finer than the TP=1 artifact);
ZeRO-3 is refused (its parameters are partitioned).
"""

from __future__ import annotations

import contextlib

import torch

from megahash.models.quantized import dequantize_rows, quantize_rows, quantized

ATTR = "_megahash_qat"


def start_step(t) -> int:
    """The first step (0-based) trained with fake quantization."""
    return round((1.0 - t.qat_fraction) * t.steps)


def round_trip(w: torch.Tensor, bits: int) -> torch.Tensor:
    """q(w): the artifact's per-row quantize + dequantize of ``w``, in ``w``'s dtype."""
    q, s = quantize_rows(w, bits)
    return dequantize_rows(q, s, w.shape).to(w.dtype)


class FakeQuant:
    """The hidden matrices of ``module`` and whether the current step fake-quantizes them."""

    def __init__(self, module: torch.nn.Module, t):
        self.bits, self.start, self.active = int(t.qat_bits), start_step(t), False
        self.params = [
            p for n, p in module.named_parameters() if n.startswith("decoder.") and p.requires_grad and quantized(n, p)
        ]

    @contextlib.contextmanager
    def applied(self):
        """q(w) in the parameters for the block (forward and backward), w restored after (the STE)."""
        if not self.active:
            yield
            return
        live = [p.data for p in self.params]
        with torch.no_grad():
            for p, w in zip(self.params, live):
                p.data = round_trip(w, self.bits)
        try:
            yield
        finally:
            for p, w in zip(self.params, live):
                p.data = w


def install(engine, t) -> FakeQuant | None:
    fq = FakeQuant(engine.module, t) if t.qat_bits else None
    setattr(engine, ATTR, fq)
    return fq


def set_step(engine, step: int) -> None:
    """Before the optimizer step ``step`` (0-based): on from :func:`start_step`."""
    fq = getattr(engine, ATTR, None)
    if fq is not None:
        fq.active = step >= fq.start


def applied(engine):
    """The context of one micro-batch's forward and backward (nothing when QAT is off or not yet on)."""
    fq = getattr(engine, ATTR, None)
    return fq.applied() if fq is not None else contextlib.nullcontext()
