"""Everything megahash knows about CPU and GPU, and the only package that touches CUDA (a house rule:
tests/test_house_rules.py). One module per job; the decisions are :mod:`policy`'s, the others ask it:

- :mod:`~megahash.accelerator.policy`: device, backend, dtypes and autocast, fused AdamW, compilation, the
  packed-documents attention kernel (FlexAttention or SDPA), the CPU GEMM levers (``training_settings`` lists them);
- :mod:`~megahash.accelerator.process_groups`: the default group and megatron-core's model-parallel state,
  DeepSpeed's ``mpu``, rank, barrier, teardown;
- :mod:`~megahash.accelerator.patches`: megatron-core's CPU shims and the fixes to megatron-core and DeepSpeed;
- :mod:`~megahash.accelerator.deepspeed_ops`: DeepSpeed's JIT-built CPU ops (build folder, build, shared memory);
- :mod:`~megahash.accelerator.host_allocator`: glibc's allocator for long CPU runs (opt-in);
- :mod:`~megahash.accelerator.rng`: seeding and the random states a checkpoint keeps;
- :mod:`~megahash.accelerator.measurement`: device syncs, peak FLOP/s and memory, profiler activities.

``python -m megahash.accelerator`` prints DeepSpeed's name of the accelerator (``DS_ACCELERATOR``).
"""

_MOVED = {
    "policy": "has_gpu deepspeed_accelerator backend device train_dtype param_dtype autocast_dtype "
    "autocast_args compute_context compute_tolerance FLEX_MIN_HEAD_DIM FLEX_DTYPES document_attention_kernel "
    "flex_attention compile_layers adamw_options split_glu_gemms onednn_linear training_settings",
    "process_groups": "dist_env init_distributed DeepSpeedMPU rank barrier teardown releasing_group release_group",
    "patches": "apply_cpu_shims apply_megatron_fixes deepspeed_collectives_by_current_names",
    "deepspeed_ops": "STALE_BUILD_LOCK_S prepare_deepspeed_extensions build_deepspeed_ops release_deepspeed_shm",
    "host_allocator": "tune_host_allocator",
    "rng": "seed_all rng_state set_rng_state",
    "measurement": "synchronize peak_flops peak_memory_bytes profiler_activities MEMORY_HISTORY_ENTRIES "
    "record_memory_history dump_memory_snapshot",
}


def __getattr__(name: str):
    """A name of the former single module ``megahash/accelerator.py``: one line naming its module now."""
    home = next((module for module, names in _MOVED.items() if name in names.split()), None)
    if home is None:
        raise AttributeError(f"module 'megahash.accelerator' has no attribute {name!r}")
    raise AttributeError(
        f"megahash.accelerator.{name} is now megahash.accelerator.{home}.{name} "
        f"(from megahash.accelerator import {home})"
    )
