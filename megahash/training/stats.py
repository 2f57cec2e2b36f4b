"""Run statistics computed at log intervals only (never on every step: they sync the host).

- :func:`param_norm`: global L2 norm of the model's parameters, the same number at any TP size or
  ZeRO stage (TP-split parameters summed over the TP group, ZeRO-3 partitions over the DP group).
"""

from __future__ import annotations

import torch


def param_norm(model: torch.nn.Module, zero_stage: int) -> float:
    """Collective over the model-parallel and (ZeRO-3) data-parallel groups: call on every rank."""
    from megatron.core import parallel_state

    split = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            t = p.ds_tensor if zero_stage == 3 and hasattr(p, "ds_tensor") else p
            sq = t.detach().double().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False):
                split += sq
            else:
                replicated += sq
    dev = next(model.parameters()).device
    if torch.distributed.is_initialized():
        vec = torch.stack([split, replicated]).to(dev)
        if zero_stage == 3:
            torch.distributed.all_reduce(vec, group=parallel_state.get_data_parallel_group())
        part = vec[:1].clone()
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(part, group=parallel_state.get_tensor_model_parallel_group())
        split, replicated = part[0].cpu(), vec[1].cpu()
    return float((split + replicated).sqrt())
