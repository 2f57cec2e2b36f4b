"""What each ``model.arch`` is: the library asks ``arch_of(cfg.model.arch).causal`` (or another capability),
never compares the name. Plain Python (no torch): config checks read it, and the Hugging Face export copies it.

- ``decoder``: Qwen2.5-style, causal self-attention, RMSNorm, SwiGLU MLP without linear biases;
- ``encoder``: BERT/RoBERTa-style, bidirectional self-attention over a padding mask, LayerNorm, GELU MLP
  with biases.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """Capabilities of one architecture."""

    name: str
    causal: bool  # causal mask: next-token prediction, decoding, lm-eval scoring; else a padding mask
    swiglu: bool  # SwiGLU MLP (3 matrices) and no linear biases; else GELU MLP (2 matrices) with biases
    rms_norm: bool  # RMSNorm; else LayerNorm
    hf_class: str  # the transformers model class of its export (megahash.models.hf_model)
    hf_auto: str  # the transformers Auto class that loads it


ARCHS = {
    "decoder": Arch(
        "decoder",
        causal=True,
        swiglu=True,
        rms_norm=True,
        hf_class="MegahashForCausalLM",
        hf_auto="AutoModelForCausalLM",
    ),
    "encoder": Arch(
        "encoder",
        causal=False,
        swiglu=False,
        rms_norm=False,
        hf_class="MegahashForMaskedLM",
        hf_auto="AutoModelForMaskedLM",
    ),
}


def arch_of(name: str) -> Arch:
    """The :class:`Arch` of a ``model.arch`` value (config checks reject others first)."""
    if name not in ARCHS:
        raise ValueError(f"model.arch must be {' or '.join(ARCHS)}, got {name!r}")
    return ARCHS[name]
