"""Process groups: the launcher's rank variables, the default group and megatron-core's model-parallel
state, DeepSpeed's ``mpu`` adapter over it, barriers, and a teardown that leaves no group, thread or
launcher variable behind (in-process commands and tests start and end many runs in one process)."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch.distributed as dist

from megahash.accelerator.deepspeed_ops import prepare_deepspeed_extensions
from megahash.accelerator.patches import apply_cpu_shims, apply_megatron_fixes
from megahash.accelerator.policy import backend, bind_rank_gpu, has_gpu

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_ENV_BEFORE: dict | None = None  # those variables before init_distributed wrote them for a one-process world


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
        bound = bind_rank_gpu(local_rank)
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
        _replace_megatron_groups(parallel_state)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    return dist.get_rank(), world


def _replace_megatron_groups(parallel_state) -> None:
    """Before megatron's groups are made again in a standing world (an in-process run, a model built for
    another TP size): destroy the old ones. megatron-core's ``destroy_model_parallel`` only forgets its
    globals, and torch keeps every group it made (``_world.pg_map``) until ``destroy_process_group(group)``
    or the world's end, each gloo group with its three threads, which wake on timers: a test process
    re-initialising ~100 times held ~3,000 threads burning half a core while idle."""
    groups = {id(g): g for g in _groups_in(vars(parallel_state).values())}
    parallel_state.destroy_model_parallel()
    _drop_megatron_groups(parallel_state)
    world = dist.GroupMember.WORLD
    for group in groups.values():
        if group is not world and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def _groups_in(values) -> list:
    """The process groups among ``values`` (megatron keeps some in lists and dicts)."""
    out = []
    for v in values:
        if isinstance(v, dist.ProcessGroup):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [g for g in v if isinstance(g, dist.ProcessGroup)]
        elif isinstance(v, dict):
            out += [g for g in v.values() if isinstance(g, dist.ProcessGroup)]
    return out


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


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's words for a peer's dead process


def collective_failed(e: BaseException) -> bool:
    """A torch.distributed collective that failed because a peer is gone (gloo: it closed or reset its
    connection; torch's DistError)."""
    return isinstance(e, getattr(dist, "DistError", ())) or (
        isinstance(e, RuntimeError) and any(words in str(e) for words in PEER_GONE)
    )


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
