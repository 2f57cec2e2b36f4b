"""RMSNorm/LayerNorm for the local (non-TransformerEngine) spec that works under sequence parallelism.

megatron-core's ``WrappedTorchNorm`` asserts ``not sequence_parallel``. Under SP every TP rank
holds a slice of the sequence, so the norm weights see only part of the gradient. We mark them
``sequence_parallel=True`` (as Megatron-LM does) and sum their gradients over the TP group with a
tensor hook during backward, which runs before DeepSpeed's ZeRO 0-2 reduction hooks
(Megatron-LM does the same after backward in ``_allreduce_layernorm_grads``).
"""

from __future__ import annotations

import contextlib

import torch


def _tp_allreduce_grad(grad: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state

    grad = grad.clone()
    torch.distributed.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
    return grad


def sum_grad_over_tp(p: torch.nn.Parameter) -> None:
    """Sum ``p``'s gradient over the TP group during backward (once per parameter; no-op at TP=1)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() > 1 and not getattr(p, "_tp_grad_summed", False):
        p.register_hook(_tp_allreduce_grad)
        p._tp_grad_summed = True


def mark_sequence_parallel(params, enabled: bool) -> None:
    """Tag parameters replicated across TP whose inputs are sequence-split, and sum their grads."""
    for p in params:
        p.sequence_parallel = bool(enabled)
        if enabled:
            sum_grad_over_tp(p)


def hook_sequence_parallel_params(module: torch.nn.Module) -> None:
    """Sum the gradients of every parameter megatron-core tagged ``sequence_parallel`` (e.g. the
    bias of a ``RowParallelLinear`` under SP, which Megatron-LM's DDP all-reduces)."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False):
            sum_grad_over_tp(p)


def _autocast_on(x: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


class _InputDtype:
    """Mixin for torch's RMSNorm/LayerNorm: normalise in the input's dtype with the weights cast to it
    (no autocast inside), so bf16 activations under autocast with fp32 weights stay bf16 (no fp32
    copy of the layer's activations) and the input and weight dtypes agree, which CUDA's fused
    ``rms_norm`` kernel needs (torch computes the statistics in fp32 inside either way)."""

    def forward(self, x):
        w = self.weight
        if w is None or (x.dtype == w.dtype and not _autocast_on(x)):
            return super().forward(x)
        # autocast off where it is on (a device autocast does not know, meta, has none to turn off)
        with torch.autocast(x.device.type, enabled=False) if _autocast_on(x) else contextlib.nullcontext():
            if isinstance(self, torch.nn.RMSNorm):
                return torch.nn.functional.rms_norm(x, self.normalized_shape, w.to(x.dtype), self.eps)
            b = None if self.bias is None else self.bias.to(x.dtype)
            return torch.nn.functional.layer_norm(x, self.normalized_shape, w.to(x.dtype), b, self.eps)


class RMSNorm(_InputDtype, torch.nn.RMSNorm):
    pass


class LayerNorm(_InputDtype, torch.nn.LayerNorm):
    pass


class HeadNorm:
    """QK-norm (Qwen3; megatron-core's ``qk_layernorm``): the layer's norm over one head's d_h
    features, shared by all heads. Each TP rank applies it to its own heads only, so its gradient
    is summed over the TP group (as Megatron-LM's ``_allreduce_layernorm_grads`` does)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> torch.nn.Module:
        norm_cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
            sum_grad_over_tp(p)
        return norm


class Norm:
    """The norm of the layer spec: torch RMSNorm (Qwen2.5) or LayerNorm (BERT), SP-aware.

    A class (built through ``__new__`` like megatron's ``WrappedTorchNorm``) because
    ``build_module`` returns plain functions uncalled.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored) -> torch.nn.Module:
        norm_cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        mark_sequence_parallel(norm.parameters(), config.sequence_parallel)
        return norm
