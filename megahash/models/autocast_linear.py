"""megatron-core's linear layers under ``torch.autocast`` on every device.

bf16 runs keep fp32 parameters and compute under autocast (``accelerator.policy.autocast_dtype``). megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` re-enters autocast in backward through
``torch.amp.custom_bwd(device_type="cuda")`` only, so on other devices its backward would multiply
the bf16 output gradient by the fp32 weight. Casting the weight (and bias) to the autocast dtype
before the call makes the layer's forward and backward run in that dtype everywhere: the same GEMMs
autocast runs on CUDA (which casts the weight inside the matmul), the weight gradient flowing back
through the cast to the fp32 parameter (summed there in fp32). Outside autocast: unchanged.
"""

from __future__ import annotations

import torch


def cast_for_autocast(t: torch.Tensor | None, device_type: str) -> torch.Tensor | None:
    """``t`` in the autocast dtype of ``device_type`` (unchanged without autocast, or for non-float tensors)."""
    if t is None or not t.is_floating_point() or not torch.is_autocast_enabled(device_type):
        return t
    return t.to(torch.get_autocast_dtype(device_type))


def keep_autocast(fn, device_type: str):
    """``fn`` run under the autocast state of this call (the forward's), for megatron's ``tensor_parallel.checkpoint``
    (``train.recompute``): it recomputes in backward, outside the forward's autocast (torch.utils.checkpoint
    restores autocast, megatron's does not), so a bf16 run's recomputed layer met bf16 activations with fp32
    weights and raised ``expected m1 and m2 to have the same dtype``. Without autocast: ``fn`` itself."""
    if not torch.is_autocast_enabled(device_type):
        return fn
    dtype = torch.get_autocast_dtype(device_type)

    def run(*args):
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args)

    return run


def _forward_impl(inner):
    def impl(input, weight, bias, *args, **kwargs):
        dev = input.device.type
        return inner(
            cast_for_autocast(input, dev), cast_for_autocast(weight, dev), cast_for_autocast(bias, dev), *args, **kwargs
        )

    impl.__dict__.update(getattr(inner, "__dict__", {}))  # e.g. cpu_linear's megahash_onednn mark
    impl.megahash_autocast = True
    return impl


def install(model: torch.nn.Module) -> int:
    """Wrap the ``_forward_impl`` of every megatron ``ColumnParallelLinear``/``RowParallelLinear``."""
    from megahash.models.linear_layers import wrap_forward_impls

    return wrap_forward_impls(model, _forward_impl, "megahash_autocast")
