"""TP- and ZeRO-independent model weights: a megatron-core dist checkpoint inside every checkpoint.

``save_weights`` writes ``step_N/model/`` from the model's ``sharded_state_dict()`` (megatron
knows how each TP shard maps into the full tensor, including the interleaved SwiGLU ``fc1``), so
a checkpoint trained at any TP size and ZeRO stage loads into a model of any other TP size.
``load_for_inference`` builds the TP=1 model of a checkpoint's resolved config in this process and
loads those weights: evaluation and Hugging Face export start from it.

Layer layouts: megatron-core's ``TransformerBlock.sharded_state_dict`` stacks the tensors of all
layers under one key per parameter name (a layer axis) unless told the layers are not homogeneous.
A schedule that mixes attention kinds (``hybrid:rndembqk:even``: ``linear_kv`` in some layers,
``linear_k``/``linear_v`` in others) leaves holes in the stacked keys and ``dist_checkpointing.save``
refuses them ("Invalid access pattern"), so such models are saved with
``metadata={"non_homogeneous_layers": True}`` (one key per layer, ``decoder.layers.N.*``);
homogeneous models keep the stacked layout. Loading tries the model's own layout, then the other.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from megahash.checkpoint.layout import EMA_DIR, WEIGHTS_DIR
from megahash.errors import CheckpointError


def gathered(module, zero_stage: int, modifier_rank: int | None = None):
    """Under ZeRO-3 parameters are partitioned: gather them for the duration of the block (a save
    reads them; with ``modifier_rank`` set, that rank's changes, e.g. loaded weights, are kept)."""
    if zero_stage == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=modifier_rank)
    return contextlib.nullcontext()


def homogeneous(model) -> bool:
    """True when every layer has the same parameter names and shapes (megatron's stacked layout works)."""
    names = [tuple(sorted((n, tuple(p.shape)) for n, p in layer.named_parameters())) for layer in model.decoder.layers]
    return len(set(names)) <= 1


def sharded_metadata(model) -> dict | None:
    """``sharded_state_dict`` metadata of the layer layout this model is saved in (module docstring)."""
    return None if homogeneous(model) else {"non_homogeneous_layers": True}


def dist_save(sharded_state_dict: dict, directory: Path, async_queue=None) -> None:
    """Collective: megatron-core ``dist_checkpointing.save`` (its default ``torch_dist`` strategy).

    Synchronously (``async_queue`` None) the files are written in this process: megatron's
    ``FileSystemWriterAsync`` would fork a writer process per file of every save (copying the page
    tables of a process holding torch: 31.5 against 24.8 CPU-s, system time 8.7 against 3.6, for six
    tests of tests/training/test_resume_every_config.py on the 2-core CI machine) and hand the results
    back through a ``multiprocessing`` Manager (a spawned server process, 2 CPU seconds at the first
    save of every process). The save is megatron's own (``async_sharded_save=True``: plan, preload,
    barrier, finalize, as ``AsyncRequest.execute_sync``), with its write done by :func:`_write_here`:
    the same files, the same bytes. With an ``async_queue`` (``train.async_save``:
    megahash/training/async_save.py) the save is planned here and its write handed to a background
    writer; the caller finalizes it.
    """
    import functools
    import queue

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if async_queue is not None:
        async_queue.save(sharded_state_dict, directory)
        return
    before, filesystem_async._results_queue = filesystem_async._results_queue, queue.Queue()
    try:  # the writer takes this results queue when it plans the save
        request = dist_checkpointing.save(sharded_state_dict, str(directory), async_sharded_save=True)
    finally:
        filesystem_async._results_queue = before
    if request.async_fn is not None:  # partial(write_preloaded_data_multiproc, transform_list, use_msc)
        request = request._replace(async_fn=functools.partial(_write_here, *request.async_fn.args))
    request.execute_sync()


def _write_here(transform_list, use_msc: bool, rank: int, write_buckets: list, results_queue) -> None:
    """megatron-core's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` without its processes:
    each file (write bucket) written by the writer's own one-file path, ``write_preloaded_data``, here
    and in turn; its results, or the first file's error, put on ``results_queue`` as that method puts
    them (the writer's ``retrieve_write_results`` reads them)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict | Exception = {}
    local, count = queue.Queue(), queue.Queue()  # the method's results and completion queues
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True, use_msc=use_msc)
        idx, out = local.get_nowait()
        if isinstance(out, Exception):
            results = out
            break
        results[idx] = out
    results_queue.put(results)


def save_weights(module: torch.nn.Module, directory: Path, zero_stage: int = 0, async_queue=None) -> None:
    """Collective: every rank contributes its shards to ``directory`` (created, must be new); with an
    ``async_queue`` the write is scheduled while the ZeRO-3 parameters are still gathered (dist_save)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with gathered(module, zero_stage):
        dist_save(module.sharded_state_dict(metadata=sharded_metadata(module)), directory, async_queue)


def error_line(e: BaseException) -> str:
    lines = [l.strip() for l in str(e).splitlines() if "Exception:" in l or "Error:" in l or "mismatch" in l]
    return (lines[-1] if lines else (str(e).strip().splitlines() or [type(e).__name__])[0])[:300]


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Collective: load the dist checkpoint in ``directory`` into ``model`` (any TP size, either layer
    layout). CheckpointError naming the mismatch when the weights are from another model."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from megahash.checkpoint.safe_unpickle import no_code_unpickling, refusal
    from megahash.known_warnings import DIST_CHECKPOINT_LOAD, silenced

    first = sharded_metadata(model)
    errors = []
    for metadata in (first, None if first else {"non_homogeneous_layers": True}):
        try:
            # RETURN_ALL: keys the model asks for that the checkpoint lacks ("unexpected" in megatron's
            # words) and checkpoint keys the model does not ask for ("missing") come back instead of
            # failing the load. Only ``_extra_state`` may differ (None for megatron's local linears; a
            # replicated K/V projection, e.g. MQA at TP=2, has none)
            with (
                no_code_unpickling(),
                silenced(DIST_CHECKPOINT_LOAD),
            ):  # data only: never run code from a checkpoint file
                loaded, extra, lacking = dist_checkpointing.load(
                    model.sharded_state_dict(metadata=metadata), str(directory), strict=StrictHandling.RETURN_ALL
                )
        except (KeyboardInterrupt, SystemExit, CheckpointError):
            raise
        except BaseException as e:  # megatron/torch raise several kinds; torch's CheckpointException is a BaseException
            if refusal(e) is not None:  # a file asked to run code: that is the one line
                raise refusal(e) from None
            errors.append(error_line(e))
            continue
        lacking = sorted(k for k in lacking if "_extra_state" not in k)
        extra = sorted(k for k in extra if "_extra_state" not in k)
        if lacking or extra:
            errors.append(f"the checkpoint lacks {lacking[:3]}" if lacking else f"the model has no {extra[:3]}")
            continue
        missing, _unexpected = model.load_state_dict(loaded, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise CheckpointError(f"checkpoint {directory} lacks weights for {missing[:3]}; it is from another model")
        return
    raise CheckpointError(f"weights in {directory} do not fit the model of its config: {errors[0]}")


def load_chosen(model: torch.nn.Module, ckpt: Path, weights: str = "live") -> None:
    """Load the weights ``weights`` names: ``live`` (``model/``), ``ema`` (``ema/``, the average of
    train.ema.decay) or the path of a quantized artifact (``megahash export --quantize``, round-tripped)."""
    if weights == "live":
        return load_weights(model, ckpt / WEIGHTS_DIR)
    if weights == "ema":
        if not (ckpt / EMA_DIR).is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} has no weight average ({EMA_DIR}/): it was trained without "
                f"train.ema.decay; use --weights live"
            )
        return load_weights(model, ckpt / EMA_DIR)
    from megahash.checkpoint.artifact import load_artifact_into

    load_artifact_into(model, Path(weights))


def check_fits(cfg, vocab: int, ckpt: Path, meta: bool = True) -> None:
    """Refuse, before anything is allocated, a model (of the checkpoint's config and vocabulary) with more
    parameters than the files of ``ckpt/model/`` have bytes (at least 2 a parameter are saved): it cannot be
    the model those files hold (a resolved_config.yaml or megahash_state.json of sizes edited upward asked for terabytes, or for
    a meta model of 10**5 layers that takes minutes to build). A layer holds at least ``hidden_size``
    parameters (its MLP's output), so that bound is checked before the meta model is built; ``meta=False``: that
    bound only (``megahash report``, which has no process group for a model)."""
    from megahash.models.megatron_model import MegahashLM

    held = sum(f.stat().st_size for f in (ckpt / WEIGHTS_DIR).rglob("*") if f.is_file())

    def refuse(n: int):
        raise CheckpointError(
            f"checkpoint {ckpt}: the model of its resolved_config.yaml and megahash_state.json has at least {n:,} "
            f"parameters, more than the {held:,} bytes of {WEIGHTS_DIR}/; its config is not the weights' (damaged or edited)"
        )

    if cfg.model.num_layers * cfg.model.hidden_size > held:
        refuse(cfg.model.num_layers * cfg.model.hidden_size)
    if not meta:
        return
    try:
        with torch.device("meta"):
            n = sum(p.numel() for p in MegahashLM(cfg, vocab, torch.float32, init=False).parameters())
    except (RuntimeError, OverflowError, ValueError, TypeError) as e:  # past int64 (torch: TypeError; ffn 1e30)
        raise CheckpointError(
            f"checkpoint {ckpt}: the model of its config cannot be built: {str(e).splitlines()[0][:200]}"
        ) from None
    if n > held:
        refuse(n)


def load_for_inference(
    path: str | Path, overrides: list[str] | None = None, dtype=torch.float32, weights: str = "live"
):
    """(cfg, model at TP=1 in eval mode, checkpoint dir) of a megahash checkpoint, in this process;
    ``weights``: which weights (:func:`load_chosen`)."""
    from megahash.accelerator import process_groups, rng
    from megahash.checkpoint.layout import padded_vocab, read_state
    from megahash.checkpoint.resolve import checkpoint_config, read_while_kept
    from megahash.models.megatron_model import MegahashLM

    def read(ckpt: Path):  # ckpt: what it reads verified (train.verify_checkpoint)
        cfg = checkpoint_config(ckpt, overrides)
        state = read_state(ckpt)
        process_groups.init_distributed(1)
        rng.seed_all(cfg.train.seed)
        vocab = padded_vocab(state, ckpt)
        check_fits(cfg, vocab, ckpt)
        model = MegahashLM(cfg, vocab, dtype, init=False)
        load_chosen(model, ckpt, weights)
        model.eval()
        return cfg, model, ckpt

    return read_while_kept(path, read, overrides)  # again from the newest if a running training pruned it
