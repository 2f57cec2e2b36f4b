"""``train.qat.bits`` / ``train.qat.fraction``: quantization-aware training for the last fraction of steps.

From step ``round((1 - fraction) * train.steps)`` on, every micro-batch's forward and backward run
with the hidden matrices (the decoder's parameters that ``megahash export`` quantizes: floating, 2-D or
more, above ``KEEP_NUMEL`` elements; megahash/models/quantized.py) replaced by their artifact round trip
``q(w)`` (per-row symmetric, fp16 scale: exactly what the artifact will hold at TP=1), and the gradient
computed there is applied to the live weights w: the straight-through estimator, dq/dw := 1
(Bengio et al. 2013; what ``torch.fake_quantize_per_channel_affine`` does for unclipped values, and no
value clips under this rule). The swap is of the parameters' storage (``p.data``) around forward and
backward, restored before the optimizer step, so the parameter names, the optimizer and checkpoints are
unchanged. With ``train.qat.bits`` every hidden matrix of the decoder runs at that width, and embeddings
and the output head train unquantized (the artifact still quantizes them). With ``train.qat.widths:
artifact`` (and ``bits`` 0) every matrix the artifact quantizes, embedding tables and head included, runs
at the width ``export.artifact`` gives its group (megahash/models/tensor_groups.py): training sees the
mixed artifact it will be stored as.
Under TP > 1 a row-parallel shard is scaled by its own rows' part (slightly finer than the TP=1 artifact);
ZeRO-3 is refused (its parameters are partitioned).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from megahash.config_checks import ranged
from megahash.errors import ConfigError
from megahash.models.quantized import FORMATS, dequantize_rows, quantize_rows, quantized
from megahash.training.hooks import Hook


@dataclass
class Config:
    """``train.qat``: fake quantization of the hidden matrices in the last steps (docs/compact_models.md)."""

    bits: Literal[0, 4, 6, 8] = 0  # bits of the fake quantization of the decoder's matrices; 0 = off
    fraction: float = ranged(0.1, "(0, 1]", "the last fraction of the steps trained with fake quantization")
    # bits: every decoder matrix at train.qat.bits | artifact: each matrix at its group's export.artifact width
    widths: Literal["bits", "artifact"] = "bits"

    def on(self) -> bool:
        return bool(self.bits) or self.widths == "artifact"

    def check(self, cfg) -> None:
        if self.bits and self.widths == "artifact":
            raise ConfigError(
                "train.qat.widths=artifact takes each group's width from export.artifact; set train.qat.bits=0"
            )
        if self.on() and cfg.train.zero_stage == 3:
            raise ConfigError(
                f"train.qat.{'bits' if self.bits else 'widths=artifact'} needs train.zero_stage 0, 1 or 2 "
                "(ZeRO-3 partitions the weights it fake-quantizes)"
            )


def start_step(t) -> int:
    """The first step (0-based) trained with fake quantization (``t``: the train config)."""
    return round((1.0 - t.qat.fraction) * t.steps)


def round_trip(w: torch.Tensor, bits: int) -> torch.Tensor:
    """q(w): the artifact's per-row quantize + dequantize of ``w``, in ``w``'s dtype."""
    q, s = quantize_rows(w, bits)
    return dequantize_rows(q, s, w.shape).to(w.dtype)


def artifact_widths(module: torch.nn.Module, artifact) -> dict[str, int]:
    """{parameter name: bits} of every parameter the artifact quantizes, at its group's format of
    ``artifact`` (the ``export.artifact`` config)."""
    from megahash.models.tensor_groups import tensor_groups

    groups = tensor_groups(module)
    return {
        n: FORMATS[getattr(artifact, groups[n])]
        for n, p in module.named_parameters()
        if p.requires_grad and quantized(n, p)
    }


class FakeQuant(Hook):
    """The hidden matrices of ``module`` and whether the current step fake-quantizes them; the run's hook
    (``t``: the train config; ``widths``: {parameter name: bits} instead of ``t.qat.bits`` for the decoder's)."""

    def __init__(self, module: torch.nn.Module, t, widths: dict[str, int] | None = None):
        self.first_step, self.active = start_step(t), False
        if widths is None:
            widths = {
                n: int(t.qat.bits)
                for n, p in module.named_parameters()
                if n.startswith("decoder.") and p.requires_grad and quantized(n, p)
            }
        named = dict(module.named_parameters())
        self.params = [named[n] for n in widths]
        self.widths = list(widths.values())

    @contextlib.contextmanager
    def applied(self):
        """q(w) in the parameters for the block (forward and backward), w restored after (the STE)."""
        if not self.active:
            yield
            return
        live = [p.data for p in self.params]
        with torch.no_grad():
            for p, w, bits in zip(self.params, live, self.widths):
                p.data = round_trip(w, bits)
        try:
            yield
        finally:
            for p, w in zip(self.params, live):
                p.data = w

    def before_step(self, run) -> None:
        """On from :func:`start_step` (``run.step``: the 0-based step about to run)."""
        self.active = run.step >= self.first_step

    def micro_batch(self, run):
        """Each micro-batch's forward and backward (nothing while not yet on)."""
        return self.applied()


def hook(run) -> FakeQuant | None:
    t, module = run.cfg.train, run.engine.module
    if not t.qat.on():
        return None
    widths = artifact_widths(module, run.cfg.export.artifact) if t.qat.widths == "artifact" else None
    return FakeQuant(module, t, widths)
