"""The only module that knows CPU from GPU.

Backend (nccl/gloo), device, dtype, the megatron-core CPU shims (DESIGN.md "Running on CPU"),
DeepSpeed's ``mpu`` adapter over ``parallel_state``, process-group set-up and clean teardown.
No other megahash module checks for CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

_SHIMS_APPLIED = False
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_ENV_BEFORE: dict | None = None  # those variables before init_distributed wrote them for a one-process world
_MALLOC_TUNED: bool | None = None


def has_gpu() -> bool:
    return torch.cuda.is_available()


def deepspeed_accelerator() -> str:
    """DeepSpeed's name of this machine's accelerator (``DS_ACCELERATOR``): named, DeepSpeed's
    launcher does not warn that it fell back to CPU (``python -m megahash.accelerator`` prints it)."""
    return "cuda" if has_gpu() else "cpu"


def split_glu_gemms(dev: torch.device | str | None = None) -> bool:
    """Run SwiGLU's gate and up projections as two GEMMs (as transformers does) instead of
    megatron's one fused ``fc1`` GEMM (megahash.models.feedforward), at one TP rank.

    On CPU: glibc serves every allocation of 32 MiB or more (the ceiling of its mmap threshold)
    with fresh pages and unmaps them on free, so the fused [s, b, 2 ffn] output and its gradient
    (exactly 32 MiB at h512, ffn 2048, seq 512, batch 4) were page-faulted in again at every step:
    126,552 minor faults per step against 2,032 for the same model in transformers (2-core AMD
    EPYC; benchmarks/results/). The halves stay under the threshold up to twice the width. On GPUs the fused GEMM
    is kept (one larger GEMM uses the device better; the caching allocator has no such cost)."""
    return _device_type(dev) == "cpu"


def onednn_linear(dev: torch.device | str | None = None) -> bool:
    """Run the linear layers' forward and input-gradient GEMMs through oneDNN on CPU
    (megahash.models.cpu_linear; fp32, one TP rank).

    torch's default CPU BLAS (MKL in the PyPI wheels) ran fp32 GEMMs of the layers' shapes at
    126-143 GFLOP/s on the 2-core AMD EPYC (AVX-512) where oneDNN ran them at 180-194 GFLOP/s;
    forward and input-gradient GEMMs 25-30% faster, weight-gradient GEMMs no faster (kept on the
    BLAS). ``MEGAHASH_ONEDNN_LINEAR=0`` turns it off. Never on GPUs (cuBLAS) or where torch has no
    oneDNN."""
    return (
        _device_type(dev) == "cpu"
        and os.environ.get("MEGAHASH_ONEDNN_LINEAR", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def device() -> torch.device:
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_type(dev: torch.device | str | None) -> str:
    """The type ("cuda", "cpu") of a named device, or of this process's device when None."""
    if dev is None:
        return device().type
    return torch.device(dev).type


def autocast_dtype(precision: str, dev: torch.device | str | None = None) -> torch.dtype | None:
    """The compute dtype of ``torch.autocast`` for a run (None: no autocast, compute in the
    parameters' dtype).

    bf16 training keeps fp32 parameters (the master weights, updated in place by one fused AdamW
    pass) and computes in bf16 under autocast, as torchtitan does (FSDP2 ``MixedPrecisionPolicy``:
    fp32 parameters, bf16 compute) and DeepSpeed's ``torch_autocast`` section provides. DeepSpeed's
    own bf16 mode instead keeps bf16 parameters with fp32 copies in its ZeRO optimizer, which on an
    H100 took 63 ms of a 260 ms step (436M parameters; per-parameter inf checks, norms and copies
    between flat buffers: ../shared/gpu/h100-2026-11-24.md) and added per-parameter copies to
    backward; the fused AdamW pass over fp32 weights is a few ms (memory-bound: 16 bytes read and
    12 written per parameter at 3 TB/s). ``benchmarks/bench_step_proxy.py`` counts both."""
    if train_dtype(precision, dev) == torch.bfloat16:
        return torch.bfloat16
    return None


def autocast_args(precision: str, dev: torch.device | str | None = None) -> dict | None:
    """``torch.autocast(**args)`` of a run's compute on a device (``device_type``, ``dtype``): what the
    DeepSpeed engine's ``torch_autocast`` applies in training and validation; None for fp32 compute."""
    dtype = autocast_dtype(precision, dev)
    return None if dtype is None else {"device_type": _device_type(dev), "dtype": dtype}


def compute_context(precision: str, dev: torch.device | str | None = None):
    """The context a forward outside the DeepSpeed engine runs under (lm-eval scoring and decoding,
    megahash.eval.lm): ``torch.autocast`` of :func:`autocast_args`, so a bf16 run is evaluated and
    decodes in the dtype it trained and validated in; a null context for fp32."""
    args = autocast_args(precision, dev)
    return contextlib.nullcontext() if args is None else torch.autocast(**args)


def compute_tolerance(precision: str, dev: torch.device | str | None = None) -> float:
    """Tolerance, relative to the logits' scale, between two evaluation orders of one forward in a run's
    compute dtype (incremental decoding against a full forward): 1e-3 in fp32, two bf16 epsilons
    (2 x 2^-7 = 0.0156) under bf16 autocast, where every GEMM rounds its output to 8 significant bits
    and the two orders round different partial sums (measured on tiny models, init std 0.02: 0 for the
    kinds whose decoding repeats the full forward's products, 2.7e-3 for approx's chunked vs
    recurrent sums; bf16 against fp32 logits 3-7e-3)."""
    dtype = autocast_dtype(precision, dev)
    return 1e-3 if dtype is None else 2 * torch.finfo(dtype).eps


FLEX_MIN_HEAD_DIM = 16  # torch's CUDA FlexAttention: "NYI: embedding dimension ... must be at least 16" (tl.dot)
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes its kernels take


def document_attention_kernel(
    dev: torch.device | str | None = None,
    dropout: bool = False,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """The kernel of softmax attention inside packed documents (``data.reset_attention_mask``,
    megahash/models/attention/document_mask.py): ``"flex"`` where FlexAttention runs (compiled, with a
    ``BlockMask`` from the document ids: no [s, s] tensor, fully masked blocks skipped), ``"sdpa"``
    otherwise: SDPA (on CPU its flash kernel) with a [b, 1, s, s] mask built once per forward.

    FlexAttention runs on CUDA for heads of at least :data:`FLEX_MIN_HEAD_DIM` dims (``head_dim``: the
    smaller of the query/key and value head widths; torch's Triton template raises NYI below 16), in
    fp32/bf16/fp16 (:data:`FLEX_DTYPES`), without attention dropout (FlexAttention has none); a ``None``
    ``head_dim`` or ``dtype`` is not checked. On CPU FlexAttention only runs compiled and without
    backward (eager it materialises the scores and its block mask took seconds to build here), and
    megahash compiles nothing on CPU by default (:func:`compile_layers`): SDPA there."""
    if _device_type(dev) != "cuda" or dropout:
        return "sdpa"
    if head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM:
        return "sdpa"
    if dtype is not None and dtype not in FLEX_DTYPES:
        return "sdpa"
    return "flex"


def flex_attention(dev: torch.device | str | None = None, compiled: bool | None = None):
    """FlexAttention as a document kernel runs it on a device: compiled on CUDA (one compilation per
    shape), eager elsewhere; ``compiled`` overrides (tests compile it on CPU, where inductor has a
    FlexAttention forward: the CUDA path's code, checked without a GPU)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if not (_device_type(dev) == "cuda" if compiled is None else compiled):
        return flex
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex, dynamic=False)
    return _FLEX


_FLEX = None


def param_dtype(precision: str, dev: torch.device | str | None = None) -> torch.dtype:
    """The dtype of the trained parameters: fp32 (bf16 runs compute under :func:`autocast_dtype`)."""
    return torch.float32


def compile_layers(setting: str, dev: torch.device | str | None = None) -> bool:
    """``train.compile``: true / false, or auto = on for CUDA devices (regional ``torch.compile`` of
    each transformer layer fuses the element-wise chains between GEMMs; bench_training on the
    H100: 123K against 87K tokens/s), off on CPU (compile time dominates short CPU runs)."""
    setting = str(setting).lower()
    if setting == "auto":
        return _device_type(dev) == "cuda"
    return setting == "true"


def training_settings(
    precision: str = "auto", compile_setting: str = "auto", dev: torch.device | str | None = None
) -> dict:
    """What the trainer picks for a device (a named one, e.g. ``"cuda"``, or this process's):
    parameter and compute dtypes, the AdamW options, compilation and the fused ops. For reports and
    tests; the trainer asks the functions named here."""
    return {
        "device": _device_type(dev),
        "param_dtype": param_dtype(precision, dev),
        "autocast_dtype": autocast_dtype(precision, dev),
        "autocast": autocast_args(precision, dev),
        "adamw": adamw_options(dev),
        "compile": compile_layers(compile_setting, dev),
        "split_glu_gemms": split_glu_gemms(dev),
        "onednn_linear": onednn_linear(dev),
        "fused_swiglu": True,
        "chunked_cross_entropy": True,
    }


def synchronize() -> None:
    """Wait for the device's queued work (timing a phase on a GPU); nothing to wait for on CPU."""
    if has_gpu():
        torch.cuda.synchronize()


def profiler_activities(dev: torch.device | str | None = None) -> list:
    """``torch.profiler``'s activities for a device (megahash.training.profile_steps): the CPU's
    operators, plus on a CUDA device its kernels and copies (Kineto's CUPTI tracer)."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if _device_type(dev) == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept (ring buffer; torchtitan's and PyTorch's docs' value)


def record_memory_history(on: bool, dev: torch.device | str | None = None) -> bool:
    """Start (``on``) or stop recording the CUDA caching allocator's allocations and frees with their
    stacks (``torch.cuda.memory._record_memory_history``), what a snapshot dumped meanwhile
    (:func:`dump_memory_snapshot`) shows at https://pytorch.org/memory_viz. Nothing to record on
    CPU; returns whether it did."""
    if _device_type(dev) != "cuda":
        return False
    torch.cuda.memory._record_memory_history(enabled="all" if on else None, max_entries=MEMORY_HISTORY_ENTRIES)
    return True


def dump_memory_snapshot(path, dev: torch.device | str | None = None) -> bool:
    """Pickle the CUDA caching allocator's state (segments, blocks, and the recorded history if any)
    to ``path`` (``torch.cuda.memory._dump_snapshot``); nothing on CPU. Returns whether it wrote."""
    if _device_type(dev) != "cuda":
        return False
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return True


def backend() -> str:
    return "nccl" if has_gpu() else "gloo"


def train_dtype(precision: str, dev: torch.device | str | None = None) -> torch.dtype:
    """The compute dtype of ``train.precision``; ``auto``: bf16 on GPU, fp32 on CPU."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return torch.float32
    return torch.bfloat16 if _device_type(dev) == "cuda" else torch.float32


def peak_flops(dtype: torch.dtype) -> float:
    """Dense peak FLOP/s of the device for MFU (H100/H200 SXM bf16 989 TFLOP/s); 0 if unknown."""
    if not has_gpu():
        return 0.0
    name = torch.cuda.get_device_name()
    table = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
    for key, value in table.items():
        if key in name:
            return value if dtype in (torch.bfloat16, torch.float16) else value / 2
    return 0.0


def adamw_options(dev: torch.device | str | None = None) -> dict:
    """Keyword arguments of ``torch.optim.AdamW`` for a device: the fused kernel (one multi-tensor
    pass over all parameters instead of a dozen element-wise ops per parameter) where torch has it,
    on CPU (torch >= 2.4) and on CUDA; else the multi-tensor (``foreach``) implementation."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return {"fused": True} if _device_type(dev) in _get_fused_kernels_supported_devices() else {"foreach": True}


# ------------------------------------------------------------------------------ CPU shims


class _CPURNGStatesTracker:
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


def peak_memory_bytes() -> int:
    """Peak memory of this process: max allocated on the GPU, else the peak RSS (``ru_maxrss``)."""
    if has_gpu():
        return int(torch.cuda.max_memory_allocated())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


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

    class CPUTracker(_CPURNGStatesTracker, mrandom.CudaRNGStatesTracker):
        pass

    mrandom.CudaRNGStatesTracker = CPUTracker
    mrandom._CUDA_RNG_STATE_TRACKER = CPUTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _SHIMS_APPLIED = True


def tune_host_allocator() -> bool:
    """Opt-in for long CPU training runs (``MEGAHASH_MALLOC_TUNING=1``): glibc keeps freed memory
    for reuse instead of handing it back to the kernel (called by the trainer and the profiling
    harness before they build anything).

    glibc serves allocations at or above its mmap threshold (dynamic, at most 32 MiB) with fresh
    mappings and trims the top of its heap once enough of it is free, so a training step's large
    activations and gradients are page-faulted in again, zero-filled by the kernel, at every step:
    25,000-57,000 minor faults per step at h512, seq 512, batch 4 (2-core AMD EPYC), varying with
    the allocation history. With chunk mmaps off (``M_MMAP_MAX`` 0) and the heap trimmed only above
    1 GiB free (``M_TRIM_THRESHOLD``) a step takes none after the first two, the resident set
    stays at its peak (2.3 GB against 2.2 GB). In a process of its own, the megahash step measured
    no faster for it (3,388 against 3,293 ms at h512, alternating A/B; benchmarks/results/
    2026-11-23_cpu_vs_transformers_onednn.md). Off by default: without chunk
    mmaps a freed block is reused only by a request that fits it with its alignment padding, so
    the heap grows until it settles (tests/training/test_host_allocator.py), and for short runs that costs
    more than it saves: the test suite, hundreds of runs of a few steps, took 24% more CPU time
    (1,905 s against 1,542 s, kernel time 337 s against 253 s). Applies to the whole process
    from the call on; never on GPU hosts or with a C library other than glibc. Returns whether it
    was applied (idempotent)."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED is not None:
        return _MALLOC_TUNED
    _MALLOC_TUNED = False
    if has_gpu() or os.environ.get("MEGAHASH_MALLOC_TUNING", "0") != "1":
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    _MALLOC_TUNED = bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 1 << 30))
    return _MALLOC_TUNED


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


# ------------------------------------------------------------------------------ process groups


def dist_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the launcher's environment (torchrun/deepspeed set
    RANK/WORLD_SIZE/LOCAL_RANK; ``megahash.launching.env`` maps SLURM and Open MPI variables to these)."""
    from megahash.launching.env import resolve_env

    info = resolve_env()
    return info.rank, info.world_size, info.local_rank


def init_distributed(tensor_parallel: int = 1, sequence_parallel: bool = False, timeout_s: int = 600):
    """Start the process group (a 1-rank gloo group for plain ``python``) and megatron's model
    parallel state. Returns (rank, world_size)."""
    apply_cpu_shims()
    apply_megatron_fixes()
    if not has_gpu():
        prepare_deepspeed_extensions()
    from megatron.core import parallel_state

    from megahash.errors import ConfigError

    if not dist.is_initialized():
        before = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
        rank, world, local_rank = dist_env()
        bound = {}
        if has_gpu():  # bind the group to this rank's GPU (NCCL would otherwise guess it: "Guessing device ID")
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
            bound["device_id"] = device()
        dist.init_process_group(
            backend=backend(), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **bound
        )
        if world == 1:  # an in-process run: teardown gives the variables back (a later run picks its own port)
            global _ENV_BEFORE
            _ENV_BEFORE = before
    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ConfigError(
            f"parallel.tensor={tensor_parallel} does not divide the world size {world}; "
            f"launch a multiple of {tensor_parallel} ranks or lower parallel.tensor"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    return dist.get_rank(), world


STALE_BUILD_LOCK_S = 600  # a JIT build of DeepSpeed's CPU op takes about a minute on 2 cores


def prepare_deepspeed_extensions() -> Path:
    """Where DeepSpeed's JIT-built CPU ops live, made safe to use; returns that folder.

    On CPU, DeepSpeed builds its shared-memory all-reduce op (``deepspeed_shm_comm``) with torch's
    ``cpp_extension`` under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), guarded by a
    ``lock`` file. Two hazards met here: a build killed in flight leaves the lock and every later launch
    waits on it forever, silently; two Pythons sharing the folder rebuild the op in turn (their include
    paths differ). So a virtual environment keeps its own (``<venv>/torch_extensions``, unless
    ``TORCH_EXTENSIONS_DIR`` is set) and a lock older than :data:`STALE_BUILD_LOCK_S` is removed, in one line."""
    import sys
    import time

    if "TORCH_EXTENSIONS_DIR" not in os.environ and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")] if root.is_dir() else ():
        age = time.time() - lock.stat().st_mtime
        if age > STALE_BUILD_LOCK_S:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            print(
                f"megahash: removed {lock}, left {age / 60:.0f} min ago by a build that was killed "
                "(torch would wait on it forever)",
                flush=True,
            )
    return root


def build_deepspeed_ops() -> None:
    """Build DeepSpeed's CPU ops now (launch/install_cpu.sh does), so no run JIT-builds them."""
    prepare_deepspeed_extensions()
    if has_gpu():
        return
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible():
        builder.load(verbose=False)


def release_deepspeed_shm() -> None:
    """Unlink this rank's DeepSpeed shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, DeepSpeed's communication backend (``deepspeed/ops/csrc/cpu/comm/shm.cpp``, built when
    the launcher sets ``LOCAL_SIZE``) creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (69 MB per rank) and never unlinks it: every run leaked it, 16 GB of RAM after a day of tests.
    The mapping stays valid after the unlink, so DeepSpeed keeps working and nothing is left behind,
    even after kill -9. Call after ``deepspeed.initialize``; collective (a barrier)."""
    if has_gpu() or not dist.is_initialized():
        return
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name)


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


class DeepSpeedMPU:
    """DeepSpeed's ``mpu`` interface over megatron-core ``parallel_state`` (model parallel = TP)."""

    def __getattr__(self, name):
        from megatron.core import parallel_state as ps

        mapping = {
            "get_model_parallel_rank": ps.get_tensor_model_parallel_rank,
            "get_model_parallel_world_size": ps.get_tensor_model_parallel_world_size,
            "get_model_parallel_group": ps.get_tensor_model_parallel_group,
            "get_data_parallel_rank": ps.get_data_parallel_rank,
            "get_data_parallel_world_size": ps.get_data_parallel_world_size,
            "get_data_parallel_group": ps.get_data_parallel_group,
            "get_tensor_model_parallel_rank": ps.get_tensor_model_parallel_rank,
            "get_tensor_model_parallel_world_size": ps.get_tensor_model_parallel_world_size,
            "get_tensor_model_parallel_group": ps.get_tensor_model_parallel_group,
            "get_pipeline_model_parallel_rank": lambda: 0,
            "get_pipeline_model_parallel_world_size": lambda: 1,
        }
        if name in mapping:
            return mapping[name]
        raise AttributeError(name)


def rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def teardown(barrier: bool = True) -> None:
    """Barrier, destroy megatron state and the process group (avoids rare aborts at exit).

    ``barrier=False`` on an error path: a rank that failed must not wait for ranks that will never
    reach the barrier (the launcher then stops the others)."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    _drop_megatron_groups(parallel_state)
    _drop_deepspeed_world_default()
    _restore_launcher_env()


@contextlib.contextmanager
def releasing_group():
    """Tear down, on leaving, a process group started inside the block (a caller's group is left
    alone): what an in-process command or evaluation uses so that it leaves no group, no gloo
    threads and no launcher variables behind."""
    started_here = not dist.is_initialized()
    try:
        yield
    finally:
        if started_here and dist.is_initialized():
            release_group()


def release_group() -> None:
    """``teardown(barrier=False)``, then a garbage collection: models and engines sit in reference
    cycles that hold the destroyed groups (megatron layers keep their TP group), and a destroyed gloo
    group's threads end only when its last reference goes."""
    import gc

    teardown(barrier=False)
    gc.collect()


def _restore_launcher_env() -> None:
    global _ENV_BEFORE
    before, _ENV_BEFORE = _ENV_BEFORE, None
    for name, value in (before or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _drop_megatron_groups(parallel_state) -> None:
    """Forget the process groups megatron-core's ``destroy_model_parallel`` leaves in its globals.

    A destroyed gloo group keeps its threads (two ``pt_gloo_runloop``, one ``gloo_tcp_loop``) until
    the last reference to it goes; megatron-core 0.16.1 never resets
    ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP[_GLOO]``, so every in-process run left its groups'
    threads behind (tests/test_no_leaks.py)."""
    for name, value in list(vars(parallel_state).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)


def _drop_deepspeed_world_default() -> None:
    """Forget the world group that DeepSpeed's ``TorchBackend.barrier``/``monitored_barrier`` took as
    their default argument when ``deepspeed.comm.torch`` was first imported inside a run.

    The default (``group=GroupMember.WORLD``, evaluated at import) kept the first run's destroyed
    world group, its gloo threads and its TCPStore thread for the life of the process, and would
    hand that dead group to a later run's barrier; None is what DeepSpeed resolves to the current
    world at call time (deepspeed/comm/torch.py)."""
    import inspect
    import sys

    backend = getattr(sys.modules.get("deepspeed.comm.torch"), "TorchBackend", None)
    for name in ("barrier", "monitored_barrier"):
        fn = getattr(backend, name, None)
        fn = inspect.unwrap(fn) if fn is not None else None
        defaults = getattr(fn, "__defaults__", None) or ()
        if defaults and isinstance(defaults[0], dist.ProcessGroup):
            fn.__defaults__ = (None, *defaults[1:])


if __name__ == "__main__":  # launch/quickstart.sh: DS_ACCELERATOR for the DeepSpeed launcher
    print(deepspeed_accelerator())
