"""Wrapping the ``_forward_impl`` of megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``
(the function their forward calls with input, weight, bias and the communication flags): the one way
megahash reroutes those layers' GEMMs (``cpu_linear``: oneDNN on CPU; ``autocast_linear``: weight
casts under autocast)."""

from __future__ import annotations

import torch


def wrap_forward_impls(model: torch.nn.Module, wrap, mark: str) -> int:
    """Replace each megatron linear layer's ``_forward_impl`` by ``wrap(impl)`` unless its current
    impl carries the attribute ``mark`` already; returns how many layers were wrapped."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and not getattr(m._forward_impl, mark, False):
            m._forward_impl = wrap(m._forward_impl)
            n += 1
    return n
