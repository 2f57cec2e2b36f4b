"""The layers' feed-forward sublayer: megatron-core's TP-split ``MLP`` (SwiGLU in decoders,
GELU in the RoBERTa layout), with the gate and up GEMMs of SwiGLU run as two GEMMs where that is
faster (``accelerator.split_glu_gemms``).

SwiGLU: FFN(x) = W_2 (SiLU(x W_g) * (x W_u)) (Shazeer 2020). megatron keeps W_g and W_u as one
``linear_fc1`` weight ([W_g; W_u] per TP rank) and computes one GEMM into [s, b, 2 ffn / tp]; the
split form multiplies by the two halves of the same weight (same parameters, same checkpoints,
the same function up to floating-point summation order).
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP

from megahash import accelerator
from megahash.models import cpu_linear


class FeedForward(MLP):
    def _split_glu(self) -> bool:
        c = self.config
        return (c.gated_linear_unit and c.activation_func is F.silu and not c.add_bias_linear
                and c.activation_func_clamp_value is None and not c.glu_linear_offset
                and parallel_state.get_tensor_model_parallel_world_size() == 1
                and accelerator.split_glu_gemms())

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self._split_glu():
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        w = self.linear_fc1.weight
        f = w.shape[0] // 2
        inner = F.silu(cpu_linear.linear(hidden_states, w[:f])) * cpu_linear.linear(hidden_states, w[f:])
        return self.linear_fc2(inner)
