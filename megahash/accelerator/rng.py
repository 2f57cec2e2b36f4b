"""Every random generator of a rank: seeding (python, numpy, torch, megatron-core's tracker streams), the
states a checkpoint saves and restores, and the tracker that keeps megatron-core's streams on CPU."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from megahash.accelerator.policy import has_gpu


class CPURNGStatesTracker:
    """megatron-core's CudaRNGStatesTracker with CPU generator states (add / fork / get / set)."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def seed_all(seed: int) -> None:
    """Seed python, numpy, torch and megatron's tracker (data-parallel / tensor-parallel streams
    as in ``model_parallel_cuda_manual_seed``)."""
    from megatron.core import parallel_state, tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if has_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed + 1024)


def rng_state() -> dict:
    """Every RNG state of this rank (python, numpy, torch, cuda, megatron tracker)."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if has_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if has_gpu() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
