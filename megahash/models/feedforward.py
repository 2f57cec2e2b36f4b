"""The layers' feed-forward sublayer: megatron-core's TP-split ``MLP`` (SwiGLU in decoders,
GELU in the RoBERTa layout), with SwiGLU's activation fused into one autograd op and, where that is
faster, the gate and up GEMMs run as two GEMMs (``accelerator.policy.split_glu_gemms``).

SwiGLU: FFN(x) = W_2 (SiLU(x W_g) * (x W_u)) (Shazeer 2020). megatron keeps W_g and W_u as one
``linear_fc1`` weight ([W_g; W_u] per TP rank) and computes one GEMM into [s, b, 2 ffn / tp]; the
split form multiplies by the two halves of the same weight (same parameters, same checkpoints,
the same function up to floating-point summation order).

:class:`SwiGLU` saves only its input (gate and up) for backward and recomputes SiLU there, as
megatron-core's ``bias_swiglu`` fusion does (without its TorchScript/TransformerEngine parts):
per layer and token 2 ffn values kept instead of 3 (gate, up and SiLU(gate)); backward
d up = g SiLU(gate), d gate = SiLU'(gate) (g up) with ATen's ``silu_backward``, written straight
into one gradient buffer (no ``cat`` of the halves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from megahash.accelerator import policy
from megahash.models import cpu_linear


def _swiglu_grads(grad, gate, up, d_gate, d_up) -> None:
    torch.mul(grad, F.silu(gate), out=d_up)
    torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)


class SwiGLU(torch.autograd.Function):
    """SiLU(gate) * up of one tensor ``x = [gate, up]`` (the last dimension in halves, megatron's fc1)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = torch.chunk(x, 2, dim=-1)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        _swiglu_grads(grad, *torch.chunk(x, 2, dim=-1), *torch.chunk(dx, 2, dim=-1))
        return dx


class SwiGLUPair(torch.autograd.Function):
    """SiLU(gate) * up of two tensors (the split-GEMM form)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_grads(grad, gate, up, d_gate, d_up)
        return d_gate, d_up


class FeedForward(MLP):
    """megatron's ``MLP`` with column/row-parallel ``linear_fc1``/``linear_fc2`` unless told otherwise."""

    def __init__(self, config, submodules=None, **kwargs):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.mlp import MLPSubmodules

        submodules = submodules or MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        super().__init__(config, submodules, **kwargs)

    def _swiglu(self) -> bool:
        c = self.config
        return (
            c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.add_bias_linear
            and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
        )

    def _split_glu(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_world_size() == 1 and policy.split_glu_gemms()

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self._swiglu():
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        if self._split_glu():
            w = self.linear_fc1.weight
            f = w.shape[0] // 2
            inner = SwiGLUPair.apply(cpu_linear.linear(hidden_states, w[:f]), cpu_linear.linear(hidden_states, w[f:]))
        else:
            inner = SwiGLU.apply(self.linear_fc1(hidden_states)[0])
        return self.linear_fc2(inner)
