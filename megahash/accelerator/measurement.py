"""What the trainer and the profilers measure on the device: device syncs for timing, peak FLOP/s (MFU), peak
memory, the profiler's activities and the CUDA caching allocator's history and snapshots."""

from __future__ import annotations

import torch

from megahash.accelerator.policy import device_type, has_gpu


def synchronize() -> None:
    """Wait for the device's queued work (timing a phase on a GPU); nothing to wait for on CPU."""
    if has_gpu():
        torch.cuda.synchronize()


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


def peak_memory_bytes() -> int:
    """Peak memory of this process: max allocated on the GPU, else the peak RSS (``ru_maxrss``)."""
    if has_gpu():
        return int(torch.cuda.max_memory_allocated())
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def profiler_activities(dev: torch.device | str | None = None) -> list:
    """``torch.profiler``'s activities for a device (megahash.training.profile_steps): the CPU's
    operators, plus on a CUDA device its kernels and copies (Kineto's CUPTI tracer)."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if device_type(dev) == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept (ring buffer; torchtitan's and PyTorch's docs' value)


def record_memory_history(on: bool, dev: torch.device | str | None = None) -> bool:
    """Start (``on``) or stop recording the CUDA caching allocator's allocations and frees with their
    stacks (``torch.cuda.memory._record_memory_history``), what a snapshot dumped meanwhile
    (:func:`dump_memory_snapshot`) shows at https://pytorch.org/memory_viz. Nothing to record on
    CPU; returns whether it did."""
    if device_type(dev) != "cuda":
        return False
    torch.cuda.memory._record_memory_history(enabled="all" if on else None, max_entries=MEMORY_HISTORY_ENTRIES)
    return True


def dump_memory_snapshot(path, dev: torch.device | str | None = None) -> bool:
    """Pickle the CUDA caching allocator's state (segments, blocks, and the recorded history if any)
    to ``path`` (``torch.cuda.memory._dump_snapshot``); nothing on CPU. Returns whether it wrote."""
    if device_type(dev) != "cuda":
        return False
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._dump_snapshot(str(path))
    return True
