"""The pretraining loop: DeepSpeed engine around a megahash model over megatron-core datasets.

One optimizer step = ``gradient_accumulation_steps`` micro-batches per data-parallel rank (set per step
under ``train.batch_ramp``: megahash/training/batch_ramp.py).
Per step it records loss, LR, grad norm, tokens/s and MFU; every ``eval_interval`` steps the
validation loss, perplexity and bits per byte of every validation set (megahash/training/valid_sets.py);
checkpoints every ``save_interval`` steps and at the end; stops cleanly on SIGUSR1/SIGTERM (checkpoint,
exit status ``EXIT_REQUEUE``).

:func:`train` reads top to bottom: :func:`_set_up` (resume point, data, model and engine, the
features' hooks, restored state, logs, batches, stop flag), :func:`_loop` (step, validate, save or stop),
:func:`_finish`; a :class:`Run` carries the state between them. The long-run features (the step guard, the
weight average, QAT, the batch ramp, validation, profiling, the hang watchdog, asynchronous saves,
evaluations) are hooks called at fixed points of the loop (megahash/training/hooks.py); none is named here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megahash.accelerator import deepspeed_ops, host_allocator, measurement, patches, policy, process_groups, rng
from megahash.config import Config, save_config
from megahash.data import documents
from megahash.data.samples import consumed_samples, step_batch
from megahash.data.text_source import RunTexts
from megahash.errors import CheckpointError, MegahashError
from megahash.known_warnings import quiet_deepspeed_logger
from megahash.training import checkpoint, engine_patches, hooks, run_lock
from megahash.training.batch_ramp import check_resume
from megahash.training.ds_config import deepspeed_config
from megahash.training.logging import RunLogger, plot_loss
from megahash.training.lr_schedule import Schedule
from megahash.training.muon import build_optimizer
from megahash.training.param_groups import param_groups
from megahash.training.profile_steps import phase
from megahash.training.signals import EXIT_REQUEUE, StopFlag, any_rank, any_ranks, release_early

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from megahash.data.dataset import Datasets
    from megahash.objectives import Objective
    from megahash.training.progress import Progress


def batch_loss(engine, batch: dict, objective) -> torch.Tensor:
    """Mean loss of a micro-batch over its loss mask."""
    dev = engine.device
    batch = {k: v.to(dev) for k, v in batch.items()}
    batch = objective.prepare(batch)
    per_token = engine(
        batch["tokens"],
        hash_codes=batch.get("hash_codes"),
        labels=batch["labels"],
        padding_mask=batch.get("padding_mask"),
        label_codes=batch.get("label_codes"),
        **documents.forward_kwargs(batch),
    )
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1.0)


def build_engine(cfg: Config, model: torch.nn.Module, dp_size: int, dtype: torch.dtype | None = None):
    """(DeepSpeed engine, LR scheduler) around ``model``: AdamW (no decay on 1-D parameters; fused
    where the device has it, ``accelerator.policy.adamw_options``), the warmup/decay schedule and the
    DeepSpeed config of ``train.zero_stage``. ``train.precision`` bf16 runs keep fp32 parameters and
    compute in bf16 under DeepSpeed's ``torch_autocast`` (``accelerator.policy.autocast_dtype``); a
    ``dtype`` of bf16 given here instead asks for DeepSpeed's own bf16 mode (bf16 parameters)."""
    import deepspeed

    patches.deepspeed_collectives_by_current_names()  # ZeRO-3's collectives without deprecation warnings
    t = cfg.train
    optimizer = build_optimizer(
        model, t, param_groups(model, t), policy.adamw_options(), dp_size
    )  # train.optimizer (Muon sharded over the data-parallel ranks at ZeRO-1/2); groups: training/param_groups.py
    scheduler = Schedule(optimizer, t)  # megatron-core's OptimizerParamScheduler, stepped by the engine
    bf16_params = dtype == torch.bfloat16 or next(model.parameters()).dtype == torch.bfloat16
    autocast = None if bf16_params else policy.autocast_dtype(t.precision)
    ds_cfg = deepspeed_config(cfg, dp_size, bf16=bf16_params, autocast=autocast)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_cfg,
        mpu=process_groups.DeepSpeedMPU(),
        dist_init_required=False,
    )
    deepspeed_ops.release_deepspeed_shm()
    from megatron.core import parallel_state

    one_rank_tp = parallel_state.get_tensor_model_parallel_world_size() == 1
    engine_patches.tune(engine, dp_size, one_rank_tp)  # the first of the engine's patches (engine_patches.py)
    return engine, scheduler


def truncated(batch: dict, length: int | None) -> dict:
    """The micro-batch cut to its first ``length`` positions (every field is [b, s, ...]; None: whole), as
    Megatron-DeepSpeed cuts a batch to its curriculum length. Document ids and positions are prefix sums of the
    tokens (megahash/data/documents.py), so their prefix is what the cut tokens would give."""
    if length is None or length >= batch["tokens"].shape[1]:
        return batch
    return {k: v[:, :length] for k, v in batch.items()}


def train_step(
    engine, batches, objective, gas: int, timings: dict | None = None, micro_batch=None, seq_length=None
) -> tuple[float, float]:
    """One optimizer step of ``gas`` micro-batches from the iterator ``batches``: (sum of the
    micro-batch losses, seconds spent waiting for batches). One host sync per step; with a
    ``timings`` dict, also the seconds of the optimizer phase (``engine.step`` of the last
    micro-batch, between device syncs: ``accelerator.measurement.synchronize``) as ``timings["optimizer_s"]``.
    ``micro_batch()``: a context around each micro-batch's forward and backward (the hooks', e.g. QAT's);
    ``seq_length``: each micro-batch cut to that many positions (:func:`truncated`; a hook's, e.g. the warm-up's)."""
    loss_sum, wait = None, 0.0
    for i in range(gas):  # phase(): the profiler's ranges in a profiled step (train.profile_steps)
        tw = time.perf_counter()
        with phase("data"):
            batch = truncated(next(batches), seq_length)
        wait += time.perf_counter() - tw
        with micro_batch() if micro_batch is not None else contextlib.nullcontext():
            with phase("forward"):
                loss = batch_loss(engine, batch, objective)
            with phase("backward"):
                engine.backward(loss)
        last = timings is not None and i == gas - 1
        if last:
            measurement.synchronize()
            to = time.perf_counter()
        with phase("optimizer"):
            engine.step()
        if last:
            measurement.synchronize()
            timings["optimizer_s"] = time.perf_counter() - to
        l = loss.detach().double()  # summed like Python floats, as before
        loss_sum = l if loss_sum is None else loss_sum + l
    return loss_sum.item(), wait


@dataclass
class Run:
    """What one run carries from step to step of :func:`train` (filled by :func:`_set_up`); the hooks read it."""

    cfg: Config
    rank: int
    world: int
    dp_rank: int = 0
    dp_size: int = 1
    data: Datasets | None = None  # megahash.data.dataset.build_datasets
    engine: DeepSpeedEngine | None = None
    objective: Objective | None = None
    step: int = 0  # optimizer steps done
    log: RunLogger | None = None
    loader: torch.utils.data.DataLoader | None = None
    batches: Iterator[dict] | None = None
    stop: StopFlag | None = None
    gas: int = 1  # micro-batches of the step under way (the batch ramp's hook sets it)
    seq_length: int | None = None  # positions of its sequences; None: data.seq_length (the warm-up's hook sets it)
    progress: Progress | None = None
    flops_tok: float | str = 0.0  # a number, or "n/a" for a kind with no cost model
    peak: float = 0.0  # peak FLOP/s of the whole world
    hooks: hooks.Hooks = field(default_factory=lambda: hooks.Hooks([]))  # the features' (hooks.build)
    saver: checkpoint.Saver = field(default_factory=checkpoint.Saver)  # or train.async_save's writer
    echo: bool = False  # the step under way shows its progress line (a hook may ask for it)
    save_requested: bool = False  # a hook asks for the checkpoint of the step under way (eval.interval)

    @property
    def save_dir(self) -> Path:
        return Path(self.cfg.train.save_dir)

    @property
    def tokens_per_step(self) -> int:
        """Tokens of the last step taken (its batch under ``train.batch_ramp``, its length under
        ``train.seq_warmup``)."""
        return step_batch(self.cfg.train, max(self.step - 1, 0)) * (self.seq_length or self.cfg.data.seq_length)

    def consumed(self, step: int) -> int:
        """Samples consumed by the first ``step`` steps (the one source: megahash.data.samples.consumed_samples)."""
        return consumed_samples(self.cfg.train, step)


def train(cfg: Config, at_end=None) -> int:
    """Run (or resume) pretraining; returns the process exit status. ``at_end(save_dir)`` runs on rank 0
    after the last step (the entry point's end-of-run evaluation, megahash/pretrain.py)."""
    quiet_deepspeed_logger()
    host_allocator.tune_host_allocator()
    tp, sp = cfg.parallel.tensor, cfg.parallel.sequence
    rank, world = process_groups.init_distributed(tp, sp, timeout_s=cfg.train.distributed_timeout_s)
    resolve_precision(cfg)  # on this rank's device, before anything reads or saves it
    run, completed = None, False
    try:  # one run per save_dir, before anything is written there
        with _peer_gone_is_one_line(cfg, rank), run_lock.held(cfg.train.save_dir, rank):
            run = _set_up(cfg, rank, world)
            with run.hooks.around_loop(run):  # the watchdog's: a collective broken by a peer's hang: requeue
                exit_status = _loop(run)
            _finish(run, exit_status, at_end)
            completed = True
            return exit_status
    finally:
        _close(run)  # after an error too: log files, TensorBoard's writer thread, wandb, loader workers
        process_groups.teardown(barrier=completed)


def resolve_precision(cfg: Config, dev=None) -> None:
    """``train.precision=auto`` as the dtype this device computes in (bf16 on GPU, fp32 on CPU), in place: the
    resolved_config.yaml a run writes then reproduces it on another device (it said auto: a CPU run's file
    trained a GPU run in bf16), and its checkpoints are evaluated in the dtype they trained in."""
    t = cfg.train
    t.precision = "bf16" if policy.train_dtype(t.precision, dev) == torch.bfloat16 else "fp32"


@contextlib.contextmanager
def _peer_gone_is_one_line(cfg: Config, rank: int):
    """The one line of a rank whose collective failed because another rank's process is gone (killed: SIGKILL,
    the out-of-memory killer, a crash). Before, gloo's RuntimeError traceback on every surviving rank."""
    from megahash.training.checkpoint_faults import first_line

    try:
        yield
    except Exception as e:
        if not process_groups.collective_failed(e):
            raise
        raise MegahashError(
            f"rank {rank} stopped: another rank's process is gone ({first_line(e)[:160]}); the launcher's output names "
            f"which rank and how it ended (killed, out of memory); a save it interrupted was not published: rerun to "
            f"resume from the newest complete checkpoint in {cfg.train.save_dir} (train.resume=auto)"
        ) from None


class _LoadFailed(Exception):
    """The checkpoint a run resumes from failed to load (on some rank): set up again from an older one."""

    def __init__(self, ckpt: Path, why: str):
        super().__init__(why)
        self.ckpt, self.why = ckpt, why


def _set_up(cfg: Config, rank: int, world: int) -> Run:
    """A set-up run (:func:`_set_up_once`). Under ``train.resume=auto`` a checkpoint that fails to load, on
    any rank and for any reason (its files damaged beyond what verification saw, a checkpoint without
    a manifest), is skipped like a damaged one: the whole set-up is done again from a fresh engine with
    the next older intact checkpoint (one warning line; none left: one line, exit 2). Loading into the
    engine a failed load left half-written would not reproduce the uninterrupted run."""
    import gc

    failed: dict[Path, str] = {}
    while True:
        run = Run(cfg, rank, world)
        try:
            _set_up_once(run, failed)
            return run
        except _LoadFailed as e:
            failed[e.ckpt] = e.why
        except BaseException:
            _close(run)
            raise
        _close(run)
        del run
        gc.collect()


# ------------------------------------------------------------------------------------------ set up


def _set_up_once(run: Run, failed: dict | None = None) -> None:
    """Set up: the resume point, the datasets, the model and its engine, the features' hooks, the restored
    state, the logs, the batch iterator, the stop flag and the progress meter, in this order; then the hooks
    start. ``failed``: checkpoints that failed to load in an earlier attempt (:func:`_set_up`)."""
    from megatron.core import parallel_state

    from megahash.objectives import build_objective

    cfg = run.cfg
    run.dp_rank, run.dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    resume_from = _resume_point(cfg, run.rank, failed or {})
    run.data = _build_data(cfg)
    model, n_params, n_emb = _build_model(cfg, run.data)
    run.engine, _ = build_engine(cfg, model, run.dp_size)
    run.hooks = hooks.build(run)  # the training features (megahash/training/hooks.py: FEATURES)
    run.objective = build_objective(cfg, run.data)
    if resume_from is not None:
        _restore(run, resume_from)
    _open_log(run, resume_from, n_params, n_emb)
    _open_batches(run)
    run.stop = _stop_flag(cfg.train)
    _start_progress(run)
    run.hooks.start(run)


def _resume_point(cfg: Config, rank: int, failed: dict) -> Path | None:
    """The checkpoint to resume from (``train.resume``: ``auto``, a checkpoint's path, or none),
    verified at ``train.verify_checkpoint`` and checked against ``cfg``; rank 0 first clears the
    leftovers of saves killed in flight (checkpoint_faults.clean_stale). ``failed``: checkpoints that
    failed to load in this process, skipped as damaged."""
    t = cfg.train
    save_dir = Path(t.save_dir)
    resume_from = None
    if rank == 0:
        from megahash.training.checkpoint_faults import clean_stale

        clean_stale(save_dir)
    if t.resume == "auto":
        resume_from = checkpoint.find_resume(save_dir, t.verify_checkpoint, failed)
    elif t.resume not in ("none", "false", ""):  # false: YAML's off/no too
        resume_from = Path(t.resume)
        if not (resume_from / checkpoint.STATE_FILE).is_file():
            from megahash.checkpoint.resolve import not_a_checkpoint

            raise not_a_checkpoint(t.resume)
        checkpoint.verify_named(resume_from, t.verify_checkpoint)
    if resume_from is not None:
        state = checkpoint.check_compatible(resume_from, cfg)
        check_resume(resume_from, state, cfg)  # its consumed samples are this config's (train.batch_ramp)
    return resume_from


def _restore(run: Run, ckpt: Path) -> None:
    """Model, optimizer, scheduler, RNG and the hooks' states and files (the bad-step guard's window, the
    weight average) from ``ckpt`` (its compatibility was checked). A failure on any rank, whatever raised it, is a
    :class:`_LoadFailed` under ``train.resume=auto`` (:func:`_set_up` falls back), one line otherwise."""
    from megahash.checkpoint.deepspeed_files import UntrustedCheckpoint
    from megahash.training.checkpoint_faults import first_line

    error = None
    try:
        state = checkpoint.load(run.engine, ckpt, run.cfg)
        run.step = int(state["step"])
        run.hooks.load(run, ckpt, state)
    except (KeyboardInterrupt, SystemExit, UntrustedCheckpoint):  # refused on every rank alike: not damage
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        error = e
    if not any_rank(error is not None):
        return
    why = f"it failed to load: {first_line(error)}" if error is not None else "it failed to load on another rank"
    if run.cfg.train.resume == "auto":
        raise _LoadFailed(ckpt, why)
    raise CheckpointError(
        f"train.resume={ckpt} cannot be resumed ({why}); it is damaged: resume from another checkpoint "
        f"(train.resume=auto takes the newest intact one)"
    ) from None


def _build_data(cfg: Config):
    """The train and validation datasets (megatron-core, cached under ``data.cache_dir``)."""
    from megahash.data.dataset import build_datasets

    t = cfg.train
    cache = cfg.data.cache_dir or str(Path(t.save_dir) / "data_cache")
    # the validation set depends on the data config alone (megahash/data/validation.py)
    return build_datasets(
        cfg, train_samples=consumed_samples(t, t.steps), valid_samples=cfg.data.valid_samples, cache_dir=cache
    )


def _build_model(cfg: Config, data) -> tuple[torch.nn.Module, int, int]:
    """(model, parameters, embedding parameters): built from ``train.seed``, its inputs prepared,
    counted over TP ranks before the engine partitions it, compiled by layer where asked."""
    from megahash.models.megatron_model import build_model

    rng.seed_all(cfg.train.seed)
    model = build_model(cfg, data.vocab_size)
    _prepare_model_inputs(model, cfg, data)
    n_params = _sum_over_tp(sum(p.numel() for p in model.parameters()), model)
    n_emb = _embedding_params(model)
    if policy.compile_layers(cfg.train.compile):
        compile_layers(model, shapes=1 + len(_validation_sizes(cfg, data)))
    return model, n_params, n_emb


def _validation_sizes(cfg: Config, data) -> set[int]:
    """The batch sizes validation runs the model at (every set's chunks), none without validation."""
    from megahash.data.validation import batch_sizes
    from megahash.training.valid_sets import sets_of

    if not cfg.train.eval_interval:
        return set()
    return set().union(*(batch_sizes(ds, cfg.data) for ds in sets_of(data).values()))


def _prepare_model_inputs(model, cfg: Config, data) -> None:
    """The inputs the layer kinds add to the model (megahash.models.kind_input), prepared from the run's
    data config (e.g. a fixed text read as token ids: models open no files)."""
    for extra in model.kind_inputs():
        extra.prepare(cfg, data.vocab_size, RunTexts(cfg))


def _open_log(run: Run, resume_from: Path | None, n_params: int, n_emb: int) -> None:
    """The resolved config and the metric logs; rank 0 announces the run."""
    cfg, t = run.cfg, run.cfg.train
    error = None
    try:
        if run.rank == 0:
            save_config(cfg, run.save_dir / "resolved_config.yaml")
        run.log = RunLogger(cfg, run.rank, run.step)  # drops what a killed run logged past this step
    except OSError as e:  # rank 0's files: a full disk, a read-only folder
        error = e
    if any_rank(error is not None):
        raise _unwritable_logs(run, error)
    if run.rank == 0:
        where = f"resumed from {resume_from}" if resume_from else "from scratch"
        dtype = policy.train_dtype(t.precision)  # the compute dtype (bf16: under autocast)
        print(
            f"megahash: {n_params:,} parameters ({n_emb:,} embedding), world {run.world} "
            f"(tp {cfg.parallel.tensor}, dp {run.dp_size}), {dtype}, ZeRO-{t.zero_stage}, {where}",
            flush=True,
        )


def _unwritable_logs(run: Run, error: OSError | None) -> MegahashError:
    """The one line of a run whose resolved config or metric log cannot be written at the start (rank 0's)."""
    from megahash.training.checkpoint_faults import disk_note, remedy

    if error is None:  # the other ranks print nothing (command_errors.run_guarded)
        return MegahashError(f"rank 0 cannot write the run's files in {run.save_dir}")
    note = disk_note(run.save_dir, error)
    what = note if note.startswith("disk full") else f"{error.strerror}: {error.filename}"
    return MegahashError(
        f"cannot write the run's config and logs in {run.save_dir} ({what}); nothing was trained or changed: "
        f"{remedy(what if what.startswith('disk full') else error)}"
    )


def _open_batches(run: Run) -> None:
    """This rank's resumable train loader, from the sample after the last one consumed."""
    from megahash.data.dataset import make_loader
    from megahash.training.signals import immune_children

    t = run.cfg.train
    run.loader = make_loader(
        run.data.train, run.consumed(run.step), t.micro_batch_size, run.dp_rank, run.dp_size, run.cfg.data.num_workers
    )
    with immune_children():  # loader workers must not die of a signal sent to the whole process tree
        run.batches = iter(run.loader)


def _stop_flag(t) -> StopFlag:
    stop = StopFlag()
    if t.exit_signal_handler:
        stop.install()  # adopts a signal that came during start-up (signals.install_early)
    else:
        release_early()
    return stop


def _start_progress(run: Run) -> None:
    """The progress meter and what MFU needs (FLOPs per token, the world's peak FLOP/s)."""
    from megahash.models.costs import train_flops_per_token
    from megahash.training.progress import Progress

    cfg = run.cfg
    run.gas = run.engine.gradient_accumulation_steps()
    run.progress = Progress(cfg.train.steps, run.step, run.rank)
    run.flops_tok = train_flops_per_token(cfg, run.data.vocab_size)
    if not isinstance(run.flops_tok, (int, float)) and run.rank == 0:
        print("MFU n/a: an attention kind of model.schedule has no cost model and cannot be measured", flush=True)
    run.peak = measurement.peak_flops(policy.train_dtype(cfg.train.precision)) * run.world


# -------------------------------------------------------------------------------------------- loop


def _loop(run: Run) -> int:
    """Loop: optimizer steps until ``train.steps``, a stop signal or ``train.stop_after``, each
    logged, validated every ``eval_interval`` and checkpointed when due; the exit status."""
    t = run.cfg.train
    while run.step < t.steps:
        with run.hooks.around_step(run):  # profiled in train.profile_steps; memory snapshot on OOM
            _train_step_logged(run)
        run.hooks.end_step(run)  # the step is logged: validation (valid_sets.py), the watchdog's span
        exit_status = _save_or_stop(run)
        run.hooks.after_save(run)  # eval.interval: pin and evaluate a due step, log finished ones
        if exit_status is not None:
            return exit_status
    return 0


def _train_step_logged(run: Run) -> None:
    """One optimizer step and its metrics (loss, LR, grad norm, tokens/s, MFU; the host-syncing
    ones on the steps the progress line shows), with the hooks before it, around its micro-batches, after
    the optimizer step (a refused non-finite step stops the run there: step_guard.py) and on its metrics."""
    from megahash.training.stats import param_norm

    t, step = run.cfg.train, run.step
    t0 = time.perf_counter()
    run.objective.set_step(step, run.dp_rank)
    lr_used = scheduler_lr(run.engine)  # engine.step() advances the scheduler: read the LR this step uses
    run.echo = (step + 1) % t.log_interval == 0 or step == 0 or step + 1 == t.steps
    run.save_requested = False
    timings = {} if run.echo else None  # the optimizer phase, timed on the steps the progress line shows
    run.hooks.before_step(run)  # e.g. the step's global batch (train.batch_ramp) as run.gas
    loss_sum, wait = train_step(
        run.engine, run.batches, run.objective, run.gas, timings, lambda: run.hooks.micro_batch(run), run.seq_length
    )
    run.hooks.after_step(run)  # before the step counts: the guard's refusal, the weight average
    step = run.step = step + 1
    dt = time.perf_counter() - t0
    tok_s = run.tokens_per_step / dt
    metrics = {
        "loss": _dp_mean(loss_sum / run.gas),
        "lr": lr_used,
        "grad_norm": _grad_norm(run.engine),
        "tokens_per_s": tok_s,
        "step_time_s": dt,
        "data_wait_s": wait,
        "consumed_samples": run.consumed(step),
        "consumed_tokens": run.consumed(step) * run.cfg.data.seq_length,
    }
    if run.peak > 0 and isinstance(run.flops_tok, (int, float)):  # "n/a": a kind with no cost model
        metrics["mfu"] = run.flops_tok * tok_s / run.peak
    if run.echo:  # host-syncing statistics at log intervals only, off the step's hot path
        metrics["optimizer_s"] = timings["optimizer_s"]
        metrics["param_norm"] = param_norm(run.engine.module, t.zero_stage)
        metrics["peak_memory_mib"] = measurement.peak_memory_bytes() / 2**20
    try:
        run.hooks.step_metrics(run, metrics)  # the ramp's batch, the guard's skips (may stop the run: logged)
    finally:
        run.log.log(step, metrics, "train", echo=False)
        run.progress.update(step, metrics, run.echo)


def _save_or_stop(run: Run) -> int | None:
    """Checkpoint when due (``save_interval``, the last step, a stop, a hook's request); on a stop (a signal
    to any rank, ``train.stop_after``) the exit status (``EXIT_REQUEUE`` after a signal), else None."""
    t, step, stop = run.cfg.train, run.step, run.stop
    # a signal to any rank stops every rank at this step; so does a history rank 0 could not write (disk full)
    signalled, unlogged = any_ranks(stop.set, run.log is not None and run.log.failed is not None)
    stopping = signalled or unlogged or (t.stop_after and step == t.stop_after)
    run.saver.poll(run)  # publishes a background save whose writers are done (train.async_save)
    due = t.save_interval and step % t.save_interval == 0 or run.save_requested
    if step == t.steps or stopping or due:
        with stop.deferred():  # helpers the save spawns must survive a signal to the whole step
            run.saver.checkpoint(run, step, wait=step == t.steps or bool(stopping))  # synchronous unless async_save
    if not stopping:
        return None
    if unlogged:
        raise _log_failed(run, step)
    if run.rank == 0:
        why = (
            (f"signal {stop.received}" if stop.set else "a signal to another rank")
            if signalled
            else f"train.stop_after={t.stop_after}"
        )
        print(f"megahash: stopped at step {step} ({why}); checkpoint saved, resume with train.resume=auto", flush=True)
    if signalled:
        stop.stop_listening()  # later copies of the signal must not kill the exit
    return EXIT_REQUEUE if signalled else 0


def _log_failed(run: Run, step: int) -> MegahashError:
    """The one line of a run stopped because rank 0 could not write ``metrics.jsonl`` (after the checkpoint of
    ``step`` was saved: a save that failed too raised its own line before)."""
    from megahash.checkpoint.layout import tag_for
    from megahash.training.checkpoint_faults import disk_note, remedy

    error = run.log.failed if run.rank == 0 else None
    if error is None:  # the other ranks print nothing (command_errors.run_guarded): rank 0 names the file
        return MegahashError("rank 0 could not write the run's metrics.jsonl; its line names the cause")
    note = disk_note(run.save_dir, error)
    return MegahashError(
        f"cannot write {error.filename} ({note if note.startswith('disk full') else error.strerror}); the run "
        f"stopped at step {step} with checkpoint {tag_for(step)} saved: {remedy(note if note.startswith('disk full') else error)}: "
        f"it resumes with train.resume=auto"
    )


# -------------------------------------------------------------------------------------------- stop


def _finish(run: Run, exit_status: int, at_end) -> None:
    """Stop: the hooks' end (evaluations still running waited for, ``eval.wait_s``, unless stopped by a
    signal), the progress meter and logs closed; after the last step, rank 0 plots the loss curve and runs
    ``at_end``."""
    done = run.step == run.cfg.train.steps
    _close(run, exit_status)
    if run.rank == 0 and run.cfg.logging.plot and done:
        print(f"megahash: loss curve {plot_loss(run.save_dir)}", flush=True)
    if run.rank == 0 and at_end is not None and done and exit_status == 0:
        at_end(run.save_dir)  # training imports no eval (house rule: no import cycles)


def _close(run: Run | None, exit_status: int | None = None) -> None:
    """Close the hooks (in reverse order: a pending background save, evaluations, the watchdog, the
    profiler; ``exit_status`` None: after an error), the progress meter and the logs and drop the batch
    iterator (its loader workers), once (None: a run whose set-up failed, closed there)."""
    if run is None:
        return
    try:
        run.hooks.close(run, exit_status)
    finally:
        if run.progress is not None:
            run.progress.close()
        if run.log is not None:
            run.log.close()
        shutdown = getattr(run.batches, "_shutdown_workers", None)
        if shutdown is not None:  # now, not when collected: an error's traceback can keep the iterator alive,
            shutdown()  # and its workers ignore SIGTERM (immune_children): interpreter exit would wait on them
        run.log = run.batches = run.loader = run.progress = None


def compile_layers(model, shapes: int = 2) -> None:
    """``torch.compile`` every transformer layer in place (regional compilation, as torchtitan does:
    one compiled graph reused by every layer of the same kind, a short compile, and parameter names
    unchanged so checkpoints do not depend on it). Decoding and evaluation run the same modules.

    ``dynamic=False``: a graph per input shape. The layers share one ``forward`` code object, so dynamo's
    recompile limit (:func:`policy.allow_recompiles`) must cover a graph per layer for each of the ``shapes``
    (grad mode, batch) pairs the run feeds it (training's micro-batch, each validation chunk size:
    ``_validation_sizes``), twice over where a kind input runs a pass of its own (fixedseqqk's fixed
    sequence, a batch of 1; under bf16 autocast in fp32 into the first layer). Counting layers rather than
    distinct kinds only raises a limit no graph reaches."""
    from megahash.models.kind_input import KindInput

    own_pass = any(type(extra).enter is not KindInput.enter for extra in model.kind_inputs())
    policy.allow_recompiles(len(model.decoder.layers) * shapes * (2 if own_pass else 1))
    for layer in model.decoder.layers:
        layer.compile(dynamic=False)


def scheduler_lr(engine) -> float:
    return float(engine.get_lr()[0])


def _grad_norm(engine) -> float:
    g = engine_patches.grad_norm(engine)
    return float(g) if g is not None else float("nan")


def _dp_mean(value: float) -> float:
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized() or parallel_state.get_data_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=policy.device())
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
