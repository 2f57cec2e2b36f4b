"""The pretraining loop: DeepSpeed engine around a megahash model over megatron-core datasets.

One optimizer step = ``gradient_accumulation_steps`` micro-batches per data-parallel rank.
Per step it records loss, LR, grad norm, tokens/s and MFU; every ``eval_interval`` steps the
validation loss and perplexity; checkpoints every ``save_interval`` steps and at the end; stops
cleanly on SIGUSR1/SIGTERM (checkpoint, exit status ``EXIT_REQUEUE``).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from megahash import accelerator
from megahash.config import Config, save_config
from megahash.data.text_source import RunTexts
from megahash.errors import CheckpointError
from megahash.training import checkpoint
from megahash.training.ds_config import deepspeed_config, tune_engine
from megahash.training.logging import RunLogger, plot_loss
from megahash.training.lr_schedule import lambda_for
from megahash.training.signals import EXIT_REQUEUE, StopFlag, any_rank, release_early


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


def build_engine(cfg: Config, model: torch.nn.Module, dp_size: int, dtype: torch.dtype | None = None):
    """(DeepSpeed engine, LR scheduler) around ``model``: AdamW (no decay on 1-D parameters; fused
    where the device has it, ``accelerator.adamw_options``), the warmup/decay schedule and the
    DeepSpeed config of ``train.zero_stage``. ``train.precision`` bf16 runs keep fp32 parameters and
    compute in bf16 under DeepSpeed's ``torch_autocast`` (``accelerator.autocast_dtype``); a
    ``dtype`` of bf16 given here instead asks for DeepSpeed's own bf16 mode (bf16 parameters)."""
    import deepspeed

    accelerator.deepspeed_collectives_by_current_names()  # ZeRO-3's collectives without deprecation warnings
    t = cfg.train
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr,
                                  betas=(t.beta1, t.beta2), eps=t.eps, **accelerator.adamw_options())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_for(t))
    bf16_params = dtype == torch.bfloat16 or next(model.parameters()).dtype == torch.bfloat16
    autocast = None if bf16_params else accelerator.autocast_dtype(t.precision)
    ds_cfg = deepspeed_config(cfg, dp_size, bf16=bf16_params, autocast=autocast)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=ds_cfg, mpu=accelerator.DeepSpeedMPU(),
                                           dist_init_required=False)
    accelerator.release_deepspeed_shm()
    tune_engine(engine, dp_size)
    return engine, scheduler


def train_step(engine, batches, objective, gas: int, timings: dict | None = None) -> tuple[float, float]:
    """One optimizer step of ``gas`` micro-batches from the iterator ``batches``: (sum of the
    micro-batch losses, seconds spent waiting for batches). One host sync per step; with a
    ``timings`` dict, also the seconds of the optimizer phase (``engine.step`` of the last
    micro-batch, between device syncs: ``accelerator.synchronize``) as ``timings["optimizer_s"]``."""
    loss_sum, wait = None, 0.0
    for i in range(gas):
        tw = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - tw
        loss = batch_loss(engine, batch, objective)
        engine.backward(loss)
        last = timings is not None and i == gas - 1
        if last:
            accelerator.synchronize()
            to = time.perf_counter()
        engine.step()
        if last:
            accelerator.synchronize()
            timings["optimizer_s"] = time.perf_counter() - to
        l = loss.detach().double()  # summed like Python floats, as before
        loss_sum = l if loss_sum is None else loss_sum + l
    return loss_sum.item(), wait


def evaluate(engine, batches, objective) -> tuple[float, int, int]:
    """Token-weighted mean validation loss over the fixed validation set (megahash/data/validation.py):
    ``batches`` yields this rank's (chunk index, batch); sums are all-reduced over data-parallel
    ranks. Returns (loss, loss tokens, sequences)."""
    from megatron.core import parallel_state

    engine.eval()
    loss_sum, tokens, seqs = 0.0, 0.0, 0.0
    dev = engine.device
    with torch.no_grad():
        for chunk, batch in batches:
            objective.set_step(-1 - chunk, 0)  # corruption seeded by the chunk, never by rank or step
            batch = objective.prepare({k: v.to(dev) for k, v in batch.items()})
            per_token = engine(batch["tokens"], hash_codes=batch.get("hash_codes"), labels=batch["labels"],
                               padding_mask=batch.get("padding_mask"), label_codes=batch.get("label_codes"))
            mask = batch["loss_mask"].float()
            loss_sum += (per_token.float() * mask).sum().item()
            tokens += mask.sum().item()
            seqs += batch["tokens"].shape[0]
    engine.train()
    t = torch.tensor([loss_sum, tokens, seqs], dtype=torch.float64, device=dev)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=parallel_state.get_data_parallel_group())
    return (t[0] / t[1].clamp(min=1)).item(), int(t[1].item()), int(t[2].item())


def train(cfg: Config, at_end=None) -> int:
    """Run (or resume) pretraining; returns the process exit status. ``at_end(save_dir)`` runs on rank 0
    after the last step (the entry point's end-of-run evaluation, megahash/pretrain.py)."""
    from megatron.core import parallel_state

    from megahash.known_warnings import quiet_deepspeed_logger

    quiet_deepspeed_logger()

    from megahash.data.dataset import build_datasets, make_loader
    from megahash.data.validation import validation_batches
    from megahash.models.megatron_model import build_model
    from megahash.objectives import build_objective

    accelerator.tune_host_allocator()
    rank, world = accelerator.init_distributed(cfg.parallel.tensor, cfg.parallel.sequence)
    completed = False
    try:
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        dtype = accelerator.train_dtype(cfg.train.precision)  # the compute dtype (bf16: under autocast)
        t = cfg.train
        save_dir = Path(t.save_dir)

        resume_from = None
        if rank == 0:  # leftovers of saves killed in flight (checkpoint_faults.clean_stale)
            from megahash.training.checkpoint_faults import clean_stale

            clean_stale(save_dir)
        if t.resume == "auto":
            resume_from = checkpoint.find_resume(save_dir)
        elif t.resume not in ("none", ""):
            resume_from = Path(t.resume)
            if not (resume_from / checkpoint.STATE_FILE).is_file():
                raise CheckpointError(f"train.resume={t.resume} is not a complete megahash checkpoint")
        if resume_from is not None:
            checkpoint.check_compatible(resume_from, cfg)

        gbs = t.global_batch_size
        cache = cfg.data.cache_dir or str(save_dir / "data_cache")
        # the validation set depends on the data config alone (megahash/data/validation.py)
        data = build_datasets(cfg, train_samples=t.steps * gbs, valid_samples=cfg.data.valid_samples, cache_dir=cache)

        accelerator.seed_all(t.seed)
        model = build_model(cfg, data.vocab_size)
        for extra in model.kind_inputs():  # inputs the layer kinds add, e.g. a fixed text (models open no files)
            extra.prepare(cfg, data.vocab_size, RunTexts(cfg))
        n_params = sum(p.numel() for p in model.parameters())
        n_params = _sum_over_tp(n_params, model)
        n_emb = _embedding_params(model)
        if accelerator.compile_layers(t.compile):
            compile_layers(model)
        engine, scheduler = build_engine(cfg, model, dp_size)
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
        from megahash.training.signals import immune_children

        with immune_children():  # loader workers must not die of a signal sent to the whole process tree
            batches = iter(loader)

        def valid_batches():
            return validation_batches(data.valid, cfg.data, dp_rank, dp_size)

        stop = StopFlag()
        if t.exit_signal_handler:
            stop.install()  # adopts a signal that came during start-up (signals.install_early)
        else:
            release_early()
        gas = engine.gradient_accumulation_steps()
        from megahash.models import declarations
        from megahash.models.costs import train_flops_per_token

        from megahash.training.progress import Progress, format_line
        from megahash.training.stats import param_norm

        progress = Progress(t.steps, step, rank)
        flops_tok = train_flops_per_token(cfg, data.vocab_size)
        if not isinstance(flops_tok, (int, float)) and rank == 0:
            print("MFU n/a: an attention kind of model.schedule has no cost model and cannot be measured", flush=True)
        peak = accelerator.peak_flops(dtype) * world
        tokens_per_step = gbs * cfg.data.seq_length
        exit_status = 0
        while step < t.steps:
            t0 = time.perf_counter()
            objective.set_step(step, dp_rank)
            lr_used = scheduler_lr(engine)  # engine.step() advances the scheduler: read the LR this step uses
            echo = (step + 1) % t.log_interval == 0 or step == 0 or step + 1 == t.steps
            timings = {} if echo else None  # the optimizer phase, timed on the steps the progress line shows
            loss_sum, wait = train_step(engine, batches, objective, gas, timings)
            step += 1
            dt = time.perf_counter() - t0
            loss_avg = _dp_mean(loss_sum / gas)
            tok_s = tokens_per_step / dt
            metrics = {"loss": loss_avg, "lr": lr_used, "grad_norm": _grad_norm(engine),
                       "tokens_per_s": tok_s, "step_time_s": dt, "data_wait_s": wait,
                       "consumed_samples": step * gbs, "consumed_tokens": step * tokens_per_step}
            if peak > 0 and isinstance(flops_tok, (int, float)):  # "n/a": a kind with no cost model
                metrics["mfu"] = flops_tok * tok_s / peak
            if echo:  # host-syncing statistics at log intervals only, off the step's hot path
                metrics["optimizer_s"] = timings["optimizer_s"]
                metrics["param_norm"] = param_norm(engine.module, t.zero_stage)
                metrics["peak_memory_mib"] = accelerator.peak_memory_bytes() / 2**20
            if not math.isfinite(loss_avg):
                raise FloatingPointError(f"loss is {loss_avg} at step {step}; lower train.lr or check the data")
            log.log(step, metrics, "train", echo=False)
            progress.update(step, metrics, echo)
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps) and data.valid is not None:
                vloss, vtokens, vseqs = evaluate(engine, valid_batches(), objective)
                vmetrics = {"loss": vloss, "tokens": vtokens, "sequences": vseqs}
                vmetrics.update(consumed_samples=step * gbs, consumed_tokens=step * tokens_per_step)
                if declarations.caps("head", cfg.model.head).token_loss and t.objective in ("clm", "mlm"):  # nats/token
                    vmetrics["ppl"] = math.exp(min(vloss, 50.0))
                log.log(step, vmetrics, "valid", echo=False)
                progress.write(format_line("valid", step, t.steps, vmetrics))
            signalled = any_rank(stop.set)  # a signal to any rank stops every rank at this step
            stopping = signalled or (t.stop_after and step == t.stop_after)
            if step == t.steps or stopping or (t.save_interval and step % t.save_interval == 0):
                with stop.deferred():  # helpers the save spawns must survive a signal to the whole step
                    checkpoint.save(engine, cfg, step, step * gbs)
            if stopping:
                if rank == 0:
                    why = (f"signal {stop.received}" if stop.set else "a signal to another rank") if signalled \
                        else f"train.stop_after={t.stop_after}"
                    print(f"megahash: stopped at step {step} ({why}); checkpoint saved, resume with train.resume=auto",
                          flush=True)
                exit_status = EXIT_REQUEUE if signalled else 0
                if signalled:
                    stop.stop_listening()  # later copies of the signal must not kill the exit
                break
        progress.close()
        log.close()
        if rank == 0 and cfg.logging.plot and step == t.steps:
            print(f"megahash: loss curve {plot_loss(save_dir)}", flush=True)
        if rank == 0 and at_end is not None and step == t.steps and exit_status == 0:
            at_end(save_dir)  # training imports no eval (house rule: no import cycles)
        completed = True
        return exit_status
    finally:
        accelerator.teardown(barrier=completed)


def compile_layers(model) -> None:
    """``torch.compile`` every transformer layer in place (regional compilation, as torchtitan does:
    one compiled graph reused by every layer of the same kind, a short compile, and parameter names
    unchanged so checkpoints do not depend on it). Decoding and evaluation run the same modules."""
    for layer in model.decoder.layers:
        layer.compile(dynamic=False)


def scheduler_lr(engine) -> float:
    return float(engine.get_lr()[0])


def _grad_norm(engine) -> float:
    from megahash.training.grad_norm import grad_norm

    g = grad_norm(engine)
    return float(g) if g is not None else float("nan")


def _dp_mean(value: float) -> float:
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device())
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
