"""The pretraining loop: DeepSpeed engine around a megahash model over megatron-core datasets.

One optimizer step = ``gradient_accumulation_steps`` micro-batches per data-parallel rank.
Per step it records loss, LR, grad norm, tokens/s and MFU; every ``eval_interval`` steps the
validation loss and perplexity; checkpoints every ``save_interval`` steps and at the end; stops
cleanly on SIGUSR1/SIGTERM (checkpoint, exit status ``EXIT_REQUEUE``).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from megahash import platform
from megahash.config import Config, save_config
from megahash.errors import CheckpointError
from megahash.training import checkpoint
from megahash.training.ds_config import deepspeed_config, tune_engine
from megahash.training.logging import RunLogger, plot_loss
from megahash.training.lr_schedule import lambda_for
from megahash.training.signals import EXIT_REQUEUE, StopFlag, any_rank


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases, norms and other 1-D parameters (Megatron's rule)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch_loss(engine, batch: dict, objective) -> torch.Tensor:
    """Mean loss of a micro-batch over its loss mask."""
    dev = engine.device
    batch = {k: v.to(dev) for k, v in batch.items()}
    batch = objective.prepare(batch)
    per_token = engine(batch["tokens"], hash_codes=batch.get("hash_codes"), labels=batch["labels"],
                       padding_mask=batch.get("padding_mask"), label_codes=batch.get("label_codes"))
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)


def build_engine(cfg: Config, model: torch.nn.Module, dp_size: int, dtype: torch.dtype):
    """(DeepSpeed engine, LR scheduler) around ``model``: AdamW (no decay on 1-D parameters), the
    warmup/decay schedule and the DeepSpeed config of ``train.zero_stage``."""
    import deepspeed

    t = cfg.train
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps, **platform.adamw_options())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_for(t))
    ds_cfg = deepspeed_config(cfg, dp_size, bf16=dtype == torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_cfg, mpu=platform.DeepSpeedMPU(),
                                           dist_init_required=False)
    tune_engine(engine, dp_size)
    return engine, scheduler


def train_step(engine, batches, objective, gas: int) -> tuple[float, float]:
    """One optimizer step of ``gas`` micro-batches from the iterator ``batches``: (sum of the
    micro-batch losses, seconds spent waiting for batches). One host sync per step."""
    loss_sum, wait = None, 0.0
    for _ in range(gas):
        tw = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - tw
        loss = batch_loss(engine, batch, objective)
        engine.backward(loss)
        engine.step()
        l = loss.detach().double()  # summed like Python floats, as before
        loss_sum = l if loss_sum is None else loss_sum + l
    return loss_sum.item(), wait


def evaluate(engine, loader_fn, iters: int, objective) -> float:
    """Mean validation loss over ``iters`` micro-batches, averaged over data-parallel ranks."""
    from megatron.core import parallel_state

    engine.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(loader_fn()):
            if i >= iters:
                break
            total += batch_loss(engine, batch, objective).item()
            n += 1
    engine.train()
    t = torch.tensor([total, float(n)], dtype=torch.float64, device=engine.device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return (t[0] / t[1].clamp(min=1)).item()


def train(cfg: Config) -> int:
    """Run (or resume) pretraining; returns the process exit status."""
    from megatron.core import parallel_state

    from megahash.data.dataset import build_datasets, make_loader
    from megahash.models.model import build_model
    from megahash.objectives import build_objective

    rank, world = platform.init_distributed(cfg.parallel.tensor, cfg.parallel.sequence)
    completed = False
    try:
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        dtype = platform.train_dtype(cfg.train.precision)
        t = cfg.train
        save_dir = Path(t.save_dir)

        resume_from = None
        if t.resume == "auto":
            resume_from = checkpoint.find_resume(save_dir)
        elif t.resume not in ("none", ""):
            resume_from = Path(t.resume)
            if not (resume_from / checkpoint.STATE_FILE).is_file():
                raise CheckpointError(f"train.resume={t.resume} is not a complete megahash checkpoint")
        if resume_from is not None:
            checkpoint.check_compatible(resume_from, cfg)

        gbs = t.global_batch_size
        valid_samples = (t.steps // max(1, t.eval_interval) + 2) * t.eval_iters * t.micro_batch_size * dp_size
        cache = cfg.data.cache_dir or str(save_dir / "data_cache")
        data = build_datasets(cfg, train_samples=t.steps * gbs, valid_samples=valid_samples, cache_dir=cache)

        platform.seed_all(t.seed)
        model = build_model(cfg, data.vocab_size)
        n_params = sum(p.numel() for p in model.parameters())
        n_params = _sum_over_tp(n_params, model)
        n_emb = _embedding_params(model)
        if t.compile:
            compile_layers(model)
        engine, scheduler = build_engine(cfg, model, dp_size, dtype)
        objective = build_objective(cfg, data)
        step = 0
        if resume_from is not None:
            state = checkpoint.load(engine, resume_from, cfg)
            step = int(state["step"])
        if rank == 0:
            save_config(cfg, save_dir / "resolved_config.yaml")
        log = RunLogger(cfg, rank)
        if rank == 0:
            where = f"resumed from {resume_from}" if resume_from else "from scratch"
            print(f"megahash: {n_params:,} parameters ({n_emb:,} embedding), world {world} "
                  f"(tp {cfg.parallel.tensor}, dp {dp_size}), {dtype}, ZeRO-{t.zero_stage}, {where}", flush=True)

        loader = make_loader(data.train, step * gbs, t.micro_batch_size, dp_rank, dp_size, cfg.data.num_workers)
        batches = iter(loader)

        def valid_loader():
            return iter(make_loader(data.valid, 0, t.micro_batch_size, dp_rank, dp_size)) if data.valid else iter(())

        stop = StopFlag()
        if t.exit_signal_handler:
            stop.install()
        gas = engine.gradient_accumulation_steps()
        from megahash.models.costs import train_flops_per_token

        flops_tok = train_flops_per_token(cfg, data.vocab_size)
        peak = platform.peak_flops(dtype) * world
        tokens_per_step = gbs * cfg.data.seq_length
        exit_status = 0
        while step < t.steps:
            t0 = time.perf_counter()
            objective.set_step(step, dp_rank)
            loss_sum, wait = train_step(engine, batches, objective, gas)
            step += 1
            dt = time.perf_counter() - t0
            loss_avg = _dp_mean(loss_sum / gas)
            tok_s = tokens_per_step / dt
            metrics = {"loss": loss_avg, "lr": scheduler_lr(engine), "grad_norm": _grad_norm(engine),
                       "tokens_per_s": tok_s, "step_time_s": dt, "data_wait_s": wait}
            if peak > 0:
                metrics["mfu"] = flops_tok * tok_s / peak
            if not math.isfinite(loss_avg):
                raise FloatingPointError(f"loss is {loss_avg} at step {step}; lower train.lr or check the data")
            log.log(step, metrics, "train", echo=(step % t.log_interval == 0 or step == 1))
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps) and data.valid is not None:
                vloss = evaluate(engine, valid_loader, t.eval_iters, objective)
                vmetrics = {"loss": vloss}
                if cfg.model.head == "vocab" and t.objective in ("clm", "mlm"):  # nats per token
                    vmetrics["ppl"] = math.exp(min(vloss, 50.0))
                log.log(step, vmetrics, "valid")
            stopping = any_rank(stop.set) or (t.stop_after and step == t.stop_after)
            if step == t.steps or stopping or (t.save_interval and step % t.save_interval == 0):
                with stop.deferred():  # helpers the save spawns must survive a signal to the whole step
                    checkpoint.save(engine, cfg, step, step * gbs)
            if stopping:
                if rank == 0:
                    why = f"signal {stop.received}" if stop.set else f"train.stop_after={t.stop_after}"
                    print(f"megahash: stopped at step {step} ({why}); checkpoint saved, resume with train.resume=auto",
                          flush=True)
                exit_status = EXIT_REQUEUE if stop.set else 0
                break
        log.close()
        if rank == 0 and cfg.logging.plot and step == t.steps:
            print(f"megahash: loss curve {plot_loss(save_dir)}", flush=True)
        if rank == 0 and cfg.eval.at_end and step == t.steps and exit_status == 0:
            from megahash.eval.run import evaluate_checkpoint

            evaluate_checkpoint(save_dir, cfg.eval.tasks or None, cfg.eval.tasks_dir or None, None,
                                batch_size=cfg.eval.batch_size)
        completed = True
        return exit_status
    finally:
        platform.teardown(barrier=completed)


def compile_layers(model) -> None:
    """``torch.compile`` every transformer layer in place (regional compilation, as torchtitan does:
    one compiled graph reused by every layer of the same kind, a short compile, and parameter names
    unchanged so checkpoints do not depend on it). Decoding and evaluation run the same modules."""
    for layer in model.decoder.layers:
        layer.compile(dynamic=False)


def scheduler_lr(engine) -> float:
    return float(engine.get_lr()[0])


def _grad_norm(engine) -> float:
    g = engine.get_global_grad_norm()
    return float(g) if g is not None else float("nan")


def _dp_mean(value: float) -> float:
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=platform.device())
    torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return (t / parallel_state.get_data_parallel_world_size()).item()


def _sum_over_tp(local: int, model) -> int:
    """Total parameters of the model across TP ranks (TP-split params counted once per shard,
    replicated ones once)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    split = sum(p.numel() for p in model.parameters() if getattr(p, "tensor_model_parallel", False))
    return (local - split) + split * tp


def _embedding_params(model) -> int:
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    n = 0
    for p in model.embedding.parameters():
        n += p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1)
    return n
