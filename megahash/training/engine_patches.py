"""Every change megahash makes to a DeepSpeed engine's behaviour, in one place and in its order.

DeepSpeed offers no hook at the points the training loop needs, so these wrap attributes of the engine
*instance* (never its class; another engine in the process is untouched). Lasting patches, applied in this
order (a later one wraps an earlier one, so the order is the call order, outermost last):

1. :func:`tune` (every run, :func:`megahash.training.trainer.build_engine`): at ZeRO-0 in fp32 and one
   data-parallel rank, no backward all-reduce (flatten every gradient, reduce over a 1-rank group, copy
   back); and DeepSpeed's clipping norm kept (:func:`keep_grad_norm`: ``clip_fp32_gradients`` replaced, and
   with clipping off ``_take_model_step`` wrapped to compute it), read by :func:`grad_norm`.
2. :func:`guard_steps` (every run, the step guard's hook, megahash/training/step_guard.py): ``backward``
   wrapped to see each micro-batch's loss, ``_take_model_step`` wrapped to decide before anything is applied
   (outside 1.'s wrapper: the guard reads the norm 1. kept while the optimizer steps); bf16 ZeRO 1-2 made to
   check its gradient norm (``check_grad_overflow``).

Patches for one call (contexts): :func:`optimizer_step` (the base optimizer's ``step`` replaced, the LR
scheduler put back after), :func:`nothing_applied` (a refused step: DeepSpeed's path with no update),
:func:`hashing_saves` (each file DeepSpeed's checkpoint engine writes handed to a hasher), and
:func:`set_batch` (the global batch of a step under ``train.batch_ramp``). Nothing else in megahash assigns to
an engine's attributes (weight averages and fake quantization are hooks of their own, not engine attributes).
The process-wide patches of DeepSpeed and megatron-core (the CPU shims, deprecated collectives) are
megahash/accelerator/patches.py's.
"""

from __future__ import annotations

import contextlib


def tune(engine, dp_size: int, one_rank_tp: bool) -> None:
    """Per-run settings of a DeepSpeed engine that its JSON config cannot express (patch 1). At ZeRO
    stage 0 in fp32 only; ``one_rank_tp``: tensor parallelism of one rank."""
    if engine.zero_optimization_stage() != 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return
    if dp_size == 1:
        engine.enable_backward_allreduce = False
    keep_grad_norm(engine, one_rank=dp_size == 1 and one_rank_tp)


def keep_grad_norm(engine, one_rank: bool = False) -> None:
    """Make :func:`grad_norm` (and ``engine.get_global_grad_norm()``) return the step's gradient norm under
    ZeRO-0, which DeepSpeed computes but does not keep: it clips through ``engine.clip_fp32_gradients`` ->
    ``clip_grad_norm_``, whose return value (the pre-clipping total norm over data- and tensor-parallel
    ranks) it drops, and ``get_global_grad_norm()`` stays None. The wrapped call keeps it (no extra pass
    over the gradients); with clipping off the same norm comes from DeepSpeed's ``get_flattened_grad_norm``.
    ``one_rank`` (TP 1, DP 1): torch's ``clip_grad_norm_`` clips the same way (coefficient max / (norm +
    1e-6)) without DeepSpeed's all-reduces over one-rank groups."""
    if engine.zero_optimization_stage() != 0:
        return
    import torch
    from deepspeed.runtime.utils import clip_grad_norm_, get_flattened_grad_norm

    def clip_and_keep():
        if one_rank:
            norm = torch.nn.utils.clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping())
        else:
            norm = clip_grad_norm_(
                parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
            )
        engine._megahash_grad_norm = norm
        engine.optimizer._global_grad_norm = norm  # DeepSpeed's engine copies it after the optimizer step

    engine.clip_fp32_gradients = clip_and_keep
    if engine.gradient_clipping() <= 0.0:
        take_step = engine._take_model_step

        def take_step_and_keep(*args, **kwargs):
            engine._megahash_grad_norm = get_flattened_grad_norm(list(engine.module.parameters()), mpu=engine.mpu)
            return take_step(*args, **kwargs)

        engine._take_model_step = take_step_and_keep


def grad_norm(engine):
    """The last step's gradient norm (None if unknown): DeepSpeed's, or the one :func:`keep_grad_norm` kept."""
    g = engine.get_global_grad_norm()
    if g is None:
        g = getattr(engine, "_megahash_grad_norm", None)
    return g


def kept_grad_norm(engine):
    """The norm :func:`keep_grad_norm` kept for the step under way (None: not kept)."""
    return getattr(engine, "_megahash_grad_norm", None)


def guard_steps(engine, observe, take_model_step) -> None:
    """Patch 2: ``engine.backward(loss)`` calls ``observe(loss)`` first; ``engine._take_model_step(lr_kwargs)``
    becomes ``take_model_step(the step it wraps, lr_kwargs)``. bf16 ZeRO 1-2 checks its gradient norm (it
    would otherwise clip with a NaN norm)."""
    if engine.bfloat16_enabled() and hasattr(engine.optimizer, "check_grad_overflow"):
        engine.optimizer.check_grad_overflow = True
    backward, take_step = engine.backward, engine._take_model_step

    def guarded_backward(loss, *args, **kwargs):
        observe(loss)
        return backward(loss, *args, **kwargs)

    engine.backward = guarded_backward
    engine._take_model_step = lambda lr_kwargs=None: take_model_step(take_step, lr_kwargs)


def applied(engine) -> bool:
    """Whether DeepSpeed's last ``_take_model_step`` applied its update (not its overflow path)."""
    return getattr(engine, "_step_applied", not getattr(engine.optimizer, "overflow", False))


def count_refused(engine) -> None:
    """A refused step that DeepSpeed stepped (a no-op) counted as its overflow path counts one."""
    engine._step_applied = False
    engine.skipped_steps += 1


@contextlib.contextmanager
def optimizer_step(engine, step):
    """During the call: the base optimizer's ``step(*args)`` is ``step(its own step, *args)``; the engine's
    LR scheduler is put back afterwards (a refused step detaches it: :func:`detach_scheduler`)."""
    base = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    own = vars(base).get("step")  # an instance-level ``step`` (a wrapper some library put there) is kept
    real, scheduler = base.step, engine.lr_scheduler
    base.step = lambda *args, **kwargs: step(real, *args, **kwargs)
    try:
        yield
    finally:
        engine.lr_scheduler = scheduler
        if own is not None:
            base.step = own
        else:
            del base.step


def detach_scheduler(engine) -> None:
    """For the rest of an :func:`optimizer_step` call: no LR scheduler step (a refused update)."""
    engine.lr_scheduler = None


@contextlib.contextmanager
def nothing_applied(engine):
    """During the call: the base optimizer's ``step`` does nothing and the engine has no LR scheduler."""
    with optimizer_step(engine, lambda real, *args, **kwargs: None):
        detach_scheduler(engine)
        yield


def set_batch(engine, batch: int) -> int:
    """Give DeepSpeed the global batch ``batch`` of the next step; its gradient accumulation steps. DeepSpeed
    finds the accumulation boundary at ``(micro_steps + 1) % gas == 0``, so the micro-step count restarts with
    a new ``gas`` (a resumed run starts it at 0 too); ZeRO-1/2 reads its own copy of ``gas`` (offload)."""
    if batch != engine.train_batch_size():
        engine.set_train_batch_size(batch)  # raises if not a multiple of micro batch x DP (checked before)
        engine.micro_steps = 0
        gas = engine.gradient_accumulation_steps()
        if hasattr(engine.optimizer, "gradient_accumulation_steps"):
            engine.optimizer.gradient_accumulation_steps = gas
    return engine.gradient_accumulation_steps()


@contextlib.contextmanager
def hashing_saves(engine, hasher):
    """While DeepSpeed saves: each file its checkpoint engine writes on this rank goes to ``hasher`` at once
    (hashed while DeepSpeed writes the next one). Only a synchronous engine's (torch.save): a decoupled one's
    files are still being written when ``save`` returns (rank 0 hashes them at the publication)."""
    inner = getattr(engine, "checkpoint_engine", None)
    if hasher is None or inner is None or inner.is_decoupled():
        yield
        return

    class Hashing:
        def save(self, state_dict, path):
            inner.save(state_dict, path)
            hasher.submit(path)

        def __getattr__(self, name):
            return getattr(inner, name)

    engine.checkpoint_engine = Hashing()
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
