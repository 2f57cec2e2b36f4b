"""DeepSpeed's CPU ops on this host: where their JIT builds live (a stale build lock removed), building them
ahead of a run, and unlinking the shared-memory buffer of the CPU all-reduce once mapped."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch.distributed as dist

from megahash.accelerator.policy import has_gpu

STALE_BUILD_LOCK_S = 600  # a JIT build of DeepSpeed's CPU op takes about a minute on 2 cores


def prepare_deepspeed_extensions() -> Path:
    """Where DeepSpeed's JIT-built CPU ops live, made safe to use; returns that folder.

    On CPU, DeepSpeed builds its shared-memory all-reduce op (``deepspeed_shm_comm``) with torch's
    ``cpp_extension`` under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), guarded by a
    ``lock`` file. Two hazards met here: a build killed in flight leaves the lock and every later launch
    waits on it forever, silently; two Pythons sharing the folder rebuild the op in turn (their include
    paths differ). So a virtual environment keeps its own (``<venv>/torch_extensions``, unless
    ``TORCH_EXTENSIONS_DIR`` is set) and a lock older than :data:`STALE_BUILD_LOCK_S` is removed, in one line.
    A third: torch runs the ``ninja`` of ``PATH``, and ninja 1.13 (the locked pip package) and 1.11 (Debian's)
    hash commands differently in the build log they share, so each switch between them rebuilt the op from
    scratch (three builds, ~80 CPU-s a file, in one CI run whose SLURM jobs and launched ranks found
    /usr/bin/ninja first). So the environment's own ninja goes first on ``PATH`` (:func:`_own_ninja_first`)."""
    import sys
    import time

    if "TORCH_EXTENSIONS_DIR" not in os.environ and sys.prefix != sys.base_prefix:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    _own_ninja_first()
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")] if root.is_dir() else ():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # the build that held it has just finished (another process of this venv)
            continue
        if age > STALE_BUILD_LOCK_S:
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            print(
                f"megahash: removed {lock}, left {age / 60:.0f} min ago by a build that was killed "
                "(torch would wait on it forever)",
                flush=True,
            )
    return root


def _own_ninja_first() -> None:
    """Put the folder of the pip package ``ninja`` (installed with this Python) first on ``PATH``, where it
    is not the ``ninja`` found already; without the package, ``PATH`` stays as it is."""
    import shutil

    try:
        import ninja
    except ImportError:
        return
    own = Path(ninja.BIN_DIR) / "ninja"
    found = shutil.which("ninja")
    if own.is_file() and (found is None or Path(found).resolve() != own.resolve()):
        os.environ["PATH"] = os.pathsep.join([str(own.parent), os.environ.get("PATH", "")])


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
