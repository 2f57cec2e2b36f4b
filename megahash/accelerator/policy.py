"""The device policy: what megahash picks on this machine's device (the one place that decides CPU from GPU).

Backend (nccl/gloo), device, parameter and compute dtypes, autocast, the fused AdamW, compilation, the
attention kernel of packed documents (FlexAttention or SDPA) and the CPU GEMM levers. Every other module asks
these functions (the rest of :mod:`megahash.accelerator` too); none checks for CUDA itself.
"""

from __future__ import annotations

import contextlib
import os

import torch


def has_gpu() -> bool:
    """Whether torch sees a CUDA device (the question every CPU/GPU branch of megahash asks)."""
    return torch.cuda.is_available()


def deepspeed_accelerator() -> str:
    """DeepSpeed's name of this machine's accelerator (``DS_ACCELERATOR``): named, DeepSpeed's
    launcher does not warn that it fell back to CPU (``python -m megahash.accelerator`` prints it)."""
    return "cuda" if has_gpu() else "cpu"


def backend() -> str:
    """The process-group backend: NCCL on GPUs, gloo on CPU."""
    return "nccl" if has_gpu() else "gloo"


def device() -> torch.device:
    """This process's device: its current GPU, else the CPU."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bind_rank_gpu(local_rank: int) -> dict:
    """Make the GPU of a rank (its local rank modulo the node's GPUs) this process's current device; the
    ``device_id`` keyword of ``init_process_group`` that binds the group to it (NCCL would otherwise guess it:
    "Guessing device ID"). Nothing to bind on CPU: ``{}``."""
    if not has_gpu():
        return {}
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return {"device_id": device()}


def device_type(dev: torch.device | str | None) -> str:
    """The type ("cuda", "cpu") of a named device, or of this process's device when None."""
    if dev is None:
        return device().type
    return torch.device(dev).type


def train_dtype(precision: str, dev: torch.device | str | None = None) -> torch.dtype:
    """The compute dtype of ``train.precision``; ``auto``: bf16 on GPU, fp32 on CPU."""
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return torch.float32
    return torch.bfloat16 if device_type(dev) == "cuda" else torch.float32


def param_dtype(precision: str, dev: torch.device | str | None = None) -> torch.dtype:
    """The dtype of the trained parameters: fp32 (bf16 runs compute under :func:`autocast_dtype`)."""
    return torch.float32


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
    return None if dtype is None else {"device_type": device_type(dev), "dtype": dtype}


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
    """The kernel of softmax attention inside packed documents (``data.reset_attention_mask``) or a sliding
    window (a kind's ``window``; megahash/models/attention/document_mask.py): ``"flex"`` where FlexAttention runs
    (compiled, with a ``BlockMask`` from the document ids and the window: no [s, s] tensor, fully masked blocks
    skipped), ``"sdpa"`` otherwise: SDPA (on CPU its flash kernel) with a [b, 1, s, s] mask built once per forward.

    FlexAttention runs on CUDA for heads of at least :data:`FLEX_MIN_HEAD_DIM` dims (``head_dim``: the
    smaller of the query/key and value head widths; torch's Triton template raises NYI below 16), in
    fp32/bf16/fp16 (:data:`FLEX_DTYPES`), without attention dropout (FlexAttention has none); a ``None``
    ``head_dim`` or ``dtype`` is not checked. On CPU FlexAttention only runs compiled and without
    backward (eager it materialises the scores and its block mask took seconds to build here), and
    megahash compiles nothing on CPU by default (:func:`compile_layers`): SDPA there."""
    if device_type(dev) != "cuda" or dropout:
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

    if not (device_type(dev) == "cuda" if compiled is None else compiled):
        return flex
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex, dynamic=False)
    return _FLEX


_FLEX = None


def allow_recompiles(graphs: int) -> None:
    """Raise dynamo's recompile limit (per code object; torch's default 8) to ``graphs`` + 8: the graphs regional
    compilation keeps for the layers' one shared ``forward`` code object (``trainer.compile_layers`` counts them:
    one per distinct layer (kind, heads, window), input (shape, dtype) and grad mode), and 8 for FlexAttention's
    compiled function (one per shape and grad mode). Past the limit dynamo runs the rest eagerly, saying so only
    in a warning: a 6-kind hybrid's validation did on CPU, the bf16 matrix's 20-kind decoder on the H200
    (2026-11-30), and a bf16 20-kind hybrid with a fixed-input kind under 2 per layer + 8 (its fixed sequence's
    own pass is one more input shape per layer). Never lowers a limit the user set higher."""
    need = graphs + 8
    if torch._dynamo.config.recompile_limit < need:
        torch._dynamo.config.recompile_limit = need


def compile_layers(setting: str, dev: torch.device | str | None = None) -> bool:
    """``train.compile``: true / false, or auto = on for CUDA devices (regional ``torch.compile`` of
    each transformer layer fuses the element-wise chains between GEMMs; bench_training on the
    H100: 123K against 87K tokens/s), off on CPU (compile time dominates short CPU runs)."""
    setting = str(setting).lower()
    if setting == "auto":
        return device_type(dev) == "cuda"
    return setting == "true"


def adamw_options(dev: torch.device | str | None = None) -> dict:
    """Keyword arguments of ``torch.optim.AdamW`` for a device: the fused kernel (one multi-tensor
    pass over all parameters instead of a dozen element-wise ops per parameter) where torch has it,
    on CPU (torch >= 2.4) and on CUDA; else the multi-tensor (``foreach``) implementation."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return {"fused": True} if device_type(dev) in _get_fused_kernels_supported_devices() else {"foreach": True}


def split_glu_gemms(dev: torch.device | str | None = None) -> bool:
    """Run SwiGLU's gate and up projections as two GEMMs (as transformers does) instead of
    megatron's one fused ``fc1`` GEMM (megahash.models.feedforward), at one TP rank.

    On CPU: glibc serves every allocation of 32 MiB or more (the ceiling of its mmap threshold)
    with fresh pages and unmaps them on free, so the fused [s, b, 2 ffn] output and its gradient
    (exactly 32 MiB at h512, ffn 2048, seq 512, batch 4) were page-faulted in again at every step:
    126,552 minor faults per step against 2,032 for the same model in transformers (2-core AMD
    EPYC; benchmarks/results/). The halves stay under the threshold up to twice the width. On GPUs the fused GEMM
    is kept (one larger GEMM uses the device better; the caching allocator has no such cost)."""
    return device_type(dev) == "cpu"


def onednn_linear(dev: torch.device | str | None = None) -> bool:
    """Run the linear layers' forward and input-gradient GEMMs through oneDNN on CPU
    (megahash.models.cpu_linear; fp32, one TP rank).

    torch's default CPU BLAS (MKL in the PyPI wheels) ran fp32 GEMMs of the layers' shapes at
    126-143 GFLOP/s on the 2-core AMD EPYC (AVX-512) where oneDNN ran them at 180-194 GFLOP/s;
    forward and input-gradient GEMMs 25-30% faster, weight-gradient GEMMs no faster (kept on the
    BLAS). ``MEGAHASH_ONEDNN_LINEAR=0`` turns it off. Never on GPUs (cuBLAS) or where torch has no
    oneDNN."""
    return (
        device_type(dev) == "cpu"
        and os.environ.get("MEGAHASH_ONEDNN_LINEAR", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def training_settings(
    precision: str = "auto", compile_setting: str = "auto", dev: torch.device | str | None = None
) -> dict:
    """What the trainer picks for a device (a named one, e.g. ``"cuda"``, or this process's):
    parameter and compute dtypes, the AdamW options, compilation and the fused ops. For reports and
    tests; the trainer asks the functions named here."""
    return {
        "device": device_type(dev),
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
