"""The patches megahash applies to megatron-core 0.16.1 and DeepSpeed (each idempotent, applied by
:func:`megahash.accelerator.process_groups.init_distributed` or before ``deepspeed.initialize``): the CPU
shims that let megatron-core run without CUDA, and fixes for warnings and deprecated collectives."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megahash.accelerator.policy import has_gpu
from megahash.accelerator.rng import CPURNGStatesTracker

_SHIMS_APPLIED = False


def apply_cpu_shims() -> None:
    """Make megatron-core 0.16 run on CPU (idempotent; a no-op on GPU machines).

    1. ``torch.cuda.current_device`` returns the CPU device (megatron allocates on it).
    2. The CUDA RNG tracker is replaced by one that keeps CPU generator states, and the
       module-level get/set state helpers used by activation recompute read the CPU state.
    3. ``torch.cuda.synchronize`` is a no-op (dist checkpointing calls it).
    4. ``torch.cuda.manual_seed`` is harmless already (lazy); nothing else needs patching because
       training uses DeepSpeed's engine, not megatron-core's DDP/optimizer (which hard-code cuda).
    5. ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (unless set): megatron-core warns at TP >= 2 when it is not 1
       (a CUDA stream setting for overlapping TP communication; no CUDA stream exists here).
    """
    global _SHIMS_APPLIED
    if _SHIMS_APPLIED or has_gpu():
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mrandom

    class CPUTracker(CPURNGStatesTracker, mrandom.CudaRNGStatesTracker):
        pass

    mrandom.CudaRNGStatesTracker = CPUTracker
    mrandom._CUDA_RNG_STATE_TRACKER = CPUTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _SHIMS_APPLIED = True


def apply_megatron_fixes() -> None:
    """Fixes for megatron-core 0.16.1 needed on every device (idempotent).

    ``RowParallelLinear.forward`` calls ``linear_with_grad_accumulation_and_async_allreduce`` with
    ``tp_group=None``, so ``get_tensor_model_parallel_group_if_none`` issues a Python warning on
    rank 0 at every forward of every output projection and MLP. Besides the cost, under
    ``torch.compile`` (``train.compile``) that warning is a graph break in every layer on rank 0
    only. The replacement returns the default TP group silently (what megatron does after warning).

    megatron-core calls ``torch.distributed.reduce_scatter_tensor`` / ``all_gather_into_tensor``, which
    torch 2.13 deprecates (a FutureWarning at TP=2 with sequence parallelism) for the same collectives
    renamed ``reduce_scatter_single`` / ``all_gather_single``: megatron's references point to those
    (DeepSpeed's: :func:`deepspeed_collectives_by_current_names`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers, mappings

    for module in (layers, mappings):
        for name, new in (
            ("dist_reduce_scatter_func", "reduce_scatter_single"),
            ("dist_all_gather_func", "all_gather_single"),
        ):
            if hasattr(dist, new) and getattr(module, name, None) in (
                dist.reduce_scatter_tensor,
                dist.all_gather_into_tensor,
            ):
                setattr(module, name, getattr(dist, new))

    original = layers.get_tensor_model_parallel_group_if_none
    if getattr(original, "_megahash_fixed", False):
        return

    def tp_group_or_default(tp_group, is_expert=False, check_initialized=True):
        if tp_group is None and dist.is_initialized() and parallel_state.is_initialized() and not is_expert:
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    tp_group_or_default._megahash_fixed = True
    layers.get_tensor_model_parallel_group_if_none = tp_group_or_default


def deepspeed_collectives_by_current_names() -> None:
    """DeepSpeed's torch backend picks ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` when it is
    created: make it pick torch's current names for the same collectives (same signatures). Called
    before ``deepspeed.initialize`` (importing DeepSpeed elsewhere would slow every tool's start)."""
    try:
        from deepspeed.comm import comm as ds_comm
        from deepspeed.comm.torch import TorchBackend
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return
    pairs = (
        ("get_reduce_scatter_function", "reduce_scatter_function", "reduce_scatter_single"),
        ("get_all_gather_function", "all_gather_function", "all_gather_single"),
    )
    for getter, attr, new in pairs:
        if not hasattr(dist, new) or getattr(getattr(TorchBackend, getter), "_megahash_current", False):
            continue
        current = getattr(dist, new)

        def pick(cls, _current=current):
            return _current

        pick._megahash_current = True
        setattr(TorchBackend, getter, classmethod(pick))
        backend = getattr(ds_comm, "cdb", None)  # already created: point it there too
        if isinstance(backend, TorchBackend) and getattr(backend, attr, None) is not None:
            setattr(backend, attr, current)
