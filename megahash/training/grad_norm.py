"""The gradient norm under ZeRO-0, which DeepSpeed computes but does not keep.

With ZeRO 1-3 ``engine.get_global_grad_norm()`` returns the pre-clipping norm of the step. Under
ZeRO-0 (fp32) DeepSpeed clips through ``engine.clip_fp32_gradients`` -> ``clip_grad_norm_``, whose
return value (the pre-clipping total norm over data- and tensor-parallel ranks) it drops, and
``get_global_grad_norm()`` stays None (every logged ``grad_norm`` was NaN). :func:`keep_zero0_grad_norm`
wraps that call on the engine instance to keep the value (no extra pass over the gradients); with
clipping off it computes the same norm with DeepSpeed's ``get_flattened_grad_norm``.
"""

from __future__ import annotations


def keep_zero0_grad_norm(engine, one_rank: bool = False) -> None:
    """Make ``grad_norm(engine)`` (and ``engine.get_global_grad_norm()``) return the step's gradient
    norm under ZeRO-0 too. ``one_rank`` (TP 1, DP 1): torch's ``clip_grad_norm_`` clips the same way
    (coefficient max / (norm + 1e-6)) without DeepSpeed's all-reduces over one-rank groups."""
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
    """The last step's gradient norm (None if unknown)."""
    g = engine.get_global_grad_norm()
    if g is None:
        g = getattr(engine, "_megahash_grad_norm", None)
    return g
