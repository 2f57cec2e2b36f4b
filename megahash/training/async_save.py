"""``train.async_save``: checkpoints written by a background writer while training goes on.

A save is planned on every rank in the step loop (the collective parts: the optimizer state
gathered per parameter, megatron-core's sharded-state validation and save plan, the RNG file) and
its tensor writes are handed to megatron-core's asynchronous dist checkpointing:
``dist_checkpointing.save(..., async_sharded_save=True)`` returns an ``AsyncRequest`` for
``model/`` and one for ``optimizer/``, scheduled on an ``AsyncCallsQueue`` (Megatron-LM's
``--async-save``). Its ``TemporalAsyncCaller`` forks a writer process per request: the fork is the
snapshot (copy-on-write pages, after the device-to-host copy on a GPU into pageable memory:
:func:`private_copies`, not megatron's pinned buffers, which the writer shares), so the next optimizer
steps may change the parameters at once. Every step polls the queue (one all-reduce while a save is in
flight, as Megatron-LM's ``maybe_finalize_async_save``); when every rank's writer has finished, the
queue finalizes the requests on all ranks (each dist checkpoint's ``.metadata`` and
``metadata.json``) and only then does rank 0 publish the checkpoint: manifest (the sha256 of every
file: each writer hashed its rank's files after writing them, in its own process; megahash/checkpoint/digest.py), state file, rename of
``step_N.tmp`` to ``step_N``, ``latest``, ``train.keep_last`` pruning (megahash/training/checkpoint.py
``publish``). Until then ``latest`` and the manifest name the previous checkpoint, so a crash (kill -9)
mid-write leaves it as the resume point (the next start removes ``step_N.tmp``), and pruning, which
only happens at a publish and only sees published ``step_N`` folders, never removes the one being
written. At most one save is in flight: a new save first waits for the pending one. The last save
of a run and the save of a stop (signal, ``train.stop_after``) are waited for before the run exits.

DeepSpeed's native files are not written by an asynchronous save: the megatron pair (``model/``,
``optimizer/``) holds the weights, Adam's moments and step counts, and resumes at any layout
(docs/resume.md); at the saved layout it is loaded the same way plus each rank's RNG state
(checkpoint.load, ``deepspeed_files: false`` in the state file), which makes the resume bit-exact
(tests/training/test_async_save.py). An optimizer that
megahash cannot address per parameter (none that megahash builds) keeps the synchronous DeepSpeed copy.

Why the forking caller and not megatron's persistent worker (``AsyncCallsQueue(persistent=True)``),
read from megatron-core 0.16.1: the persistent worker is a *spawned* process whose loop first calls
``torch.cuda.set_device(rank % torch.cuda.device_count())`` (a ZeroDivisionError without a GPU; the
CPU shims of megahash/accelerator/patches.py do not reach a spawned interpreter), and it receives the request
pickled through torch's multiprocessing, which moves CPU tensors into shared memory *in place*: on a
CPU the writer would read the live parameters while training changes them. The forking caller needs
only ``torch.cuda.synchronize`` and ``torch.cuda.current_device`` (its all-reduces), which the CPU
shims provide; its write results come back through megatron's cross-process queue (a
``multiprocessing`` Manager, started once per run here and shut down at its end; a pipe-backed queue
could block a writer whose results outgrow the pipe buffer).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from megahash.training.hooks import Hook

DELAY_ENV = "MEGAHASH_TEST_ASYNC_WRITE_DELAY"  # tests: "STEP:SECONDS", the writer of that step sleeps first


def _die_with_parent(parent: int) -> None:
    """In a helper process (writer, its file writers, the results manager): SIGKILL when its parent
    ``parent`` dies (Linux's PR_SET_PDEATHSIG; elsewhere nothing), so a killed trainer, or a writer
    killed by :meth:`_Queue.abort`, leaves no orphan: megatron's file writers would otherwise wait
    forever in ``JoinableQueue.task_done`` for their dead parent, holding the trainer's stdout. If the
    parent died before the call, exit at once. Imports nothing heavy: it is also the manager's
    initializer, run before the manager reports its address."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def _dying_with(parent: int, fn, *args, **kwargs):
    _die_with_parent(parent)
    return fn(*args, **kwargs)


def _in_writer(fn, step: int, trainer: int, directory: Path, rank: int, *args, **kwargs):
    """The body of a forked writer: die with the trainer, make megatron's file writers (forked from
    here) die with this writer, then megatron's write, then the sha256 of this rank's files of
    ``directory`` into its sidecar (megahash/checkpoint/digest.py): hashed here, off the training path,
    while the pages are still cached."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    _die_with_parent(trainer)
    own = FileSystemWriterAsync.write_preloaded_data  # patched in this forked process only
    FileSystemWriterAsync.write_preloaded_data = staticmethod(functools.partial(_dying_with, os.getpid(), own))
    at, _, secs = os.environ.get(DELAY_ENV, "").partition(":")
    if at == str(step):
        time.sleep(float(secs))
    out = fn(*args, **kwargs)
    from megahash.checkpoint.digest import Hasher

    hasher = Hasher(directory.parent, rank, label=directory.name)
    hasher.submit_rank_files(directory)
    hasher.close()
    return out


def _private(t) -> bool:
    """Whether the forked writer's copy-on-write snapshot of ``t`` is safe: ordinary private CPU memory (not a
    GPU's, not pinned, not shared)."""
    return t.device.type == "cpu" and not t.is_shared() and not t.is_pinned()


def private_copies(write_buckets: list) -> list:
    """megatron-core's ``FileSystemWriterAsync.preload_tensors`` for a forked writer: each tensor of the write
    buckets that is not in private CPU memory (:func:`_private`) copied into pageable CPU memory, which the fork
    snapshots copy-on-write; private CPU tensors as they are (the fork is their snapshot). megatron's own preload
    copies GPU tensors into pinned memory, ``non_blocking``: where the driver maps pinned memory shared (the
    copy-on-write snapshot then does not hold), the writer reads those very pages, and once ``multiprocessing``
    has started the writer the parent holds no reference to them (``Process.start`` drops its arguments). The next save's preload (the weight average's, the
    optimizer's: the same tensor sizes) was handed the same pinned blocks by torch's caching host allocator and
    wrote over them while the first writer read: the suspected cause of the GPU check's resumed runs (H100
    2026-11-28, H200 2026-11-30) continuing from the wrong weights (docs/gpu.md)."""
    out = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensors = [(item, t if _private(t) else t.to("cpu", copy=True)) for item, t in tensor_data]
        out.append((file_name, storage_key, (bytes_data, tensors)))
    return out


class _Queue:
    """megatron-core's ``AsyncCallsQueue`` (forking caller), each request with its own results queue."""

    def __init__(self, manager):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls, self.manager, self.step = AsyncCallsQueue(persistent=False), manager, 0

    def save(self, sharded_state_dict: dict, directory: Path) -> None:
        """Collective: plan the dist checkpoint of ``directory`` and schedule its write. megatron's
        writer takes the module's results queue when it is planned; one queue for every request
        would let a request's finalization read another's results (megatron has one in flight)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        filesystem_async._results_queue = self.manager.Queue()
        request = dist_checkpointing.save(sharded_state_dict, str(directory), async_sharded_save=True)
        if getattr(request.preload_fn, "args", None):  # partial(preload_tensors, write_buckets, non_blocking)
            request = request._replace(preload_fn=functools.partial(private_copies, request.preload_fn.args[0]))
        if request.async_fn is not None:
            from megahash.accelerator import process_groups

            args = (request.async_fn, self.step, os.getpid(), Path(directory), process_groups.rank())
            request = request._replace(async_fn=functools.partial(_in_writer, *args))
        self.calls.schedule_async_request(request)

    def abort(self) -> None:
        """Kill the writers of every unfinalized request (``AsyncCallsQueue.close(abort=True)`` kills
        only a persistent worker), wait for each to be gone, and forget the requests."""
        for call in self.calls.async_calls:
            writer = getattr(call.async_caller, "process", None)
            call.async_caller.close(abort=True)  # megatron kills the writer without waiting for it
            if writer is not None:
                writer.join(timeout=60)  # gone before the caller removes the folder it was writing into
        self.calls.async_calls.clear()


def _warm(manager) -> None:
    """The manager process unpickles the writers' results, importing torch at the first one (about
    2 s): done here, in a thread at the start of the run, instead of in the first save's write."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    q = manager.Queue()
    q.put(WriteResult(index=MetadataIndex("warm-up"), size_in_bytes=0, storage_data=None))
    q.get()


def _cause(e: BaseException) -> BaseException:
    """The writer's own error inside torch's ``CheckpointException`` (``failures``: rank -> (exception,
    traceback)), whose message only lists the ranks. The writer's exception crossed processes as text
    ("Worker failure: [Errno 28] ..."): an errno in it is an OSError again, so that the one-line error
    names the file and the remedy fits (disk full, fix the folder; checkpoint_faults.remedy)."""
    import re

    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return e
    inner = next(iter(failures.values()))
    inner = inner[0] if isinstance(inner, tuple) else inner
    m = re.search(r"\[Errno (\d+)\] ([^:']+)(?:: '([^']*)')?", str(inner))
    return OSError(int(m[1]), m[2].strip(), m[3]) if m else inner


class AsyncSaver:
    """The run's background checkpoint writer (one save in flight at most); ``hooks``: the run's
    (megahash.training.hooks.Hooks), whose folders and states each checkpoint keeps."""

    def __init__(self, cfg, log=None, hooks=None):
        import multiprocessing
        import threading
        from multiprocessing.managers import SyncManager

        from megahash.training.signals import immune_children

        with immune_children():  # the manager must outlive a stop signal to the process group
            self.manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            self.manager.start(_die_with_parent, (os.getpid(),))
        self.cfg, self.log, self.hooks, self.queue, self.pending = cfg, log, hooks, _Queue(self.manager), None
        self.now = 0  # the step the loop is at (the step of a publication's record)
        self.warm = threading.Thread(target=_warm, args=(self.manager,), name="megahash-async-save-warm-up")
        self.warm.start()

    def save(self, engine, step: int, consumed: int, wait: bool) -> float:
        """Collective: start the save of ``step`` (after finishing the pending one); with ``wait``,
        finish it too. Returns the seconds the caller was blocked."""
        from megahash.checkpoint import optimizer_state
        from megahash.checkpoint.layout import WEIGHTS_DIR, tag_for
        from megahash.checkpoint.rng import write_rng
        from megahash.checkpoint.weights import save_weights
        from megahash.training import checkpoint

        t0 = time.perf_counter()
        stall = self.finish(blocking=True)
        cfg, root, tag = self.cfg, Path(self.cfg.train.save_dir), tag_for(step)
        tmp = root / (tag + ".tmp")
        error, native = checkpoint.begin(root, tmp), optimizer_state.unsupported(engine) is not None
        self.queue.step = self.now = step
        try:
            if native:  # no per-parameter optimizer state: DeepSpeed's own copy, synchronously
                engine.save_checkpoint(str(root), tag=tmp.name, client_state={"megahash_step": step}, save_latest=False)
            save_weights(engine.module, tmp / WEIGHTS_DIR, cfg.train.zero_stage, self.queue)
            if self.hooks is not None:  # the features' folders (the weight average's ema/)
                self.hooks.save_files(engine, tmp, cfg.train.zero_stage, self.queue)
            optimizer_state.save(engine, tmp / optimizer_state.OPTIM_DIR, cfg.train.zero_stage, self.queue)
            write_rng(tmp)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # torch's CheckpointException is a BaseException
            error = error or e
        if error is not None:
            self.queue.abort()  # what was scheduled before the failure
        checkpoint.fail_if_any(root, tag, tmp, error)
        self.pending = {
            "tmp": tmp,
            "step": step,
            "consumed": consumed,
            "native": native,
            "engine": engine,
            "extra": self.hooks.state_dicts() if self.hooks is not None else {},  # as at this step
            "started": time.perf_counter(),
            "stall": time.perf_counter() - t0 - stall,
        }
        if wait:
            self.finish(blocking=True)
        return time.perf_counter() - t0

    def finish(self, blocking: bool) -> float:
        """Collective: finalize the pending save if every rank's writer is done (``blocking``: wait
        for them), then publish it. Returns the seconds this took."""
        from megahash.training import checkpoint

        t0 = time.perf_counter()
        p = self.pending
        if p is None:
            return 0.0
        try:
            self.queue.calls.maybe_finalize_async_calls(blocking=blocking)
            error = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a writer failed (disk full): CheckpointException on every rank
            error = _cause(e)
        if error is None and self.queue.calls.get_num_unfinalized_calls():
            return time.perf_counter() - t0
        if error is not None:
            self.queue.abort()
        self.pending = None
        root, tag = p["tmp"].parent, p["tmp"].name[: -len(".tmp")]
        checkpoint.fail_if_any(root, tag, p["tmp"], error)
        checkpoint.publish(
            p["engine"],
            self.cfg,
            p["tmp"],
            p["step"],
            p["consumed"],
            {**p["extra"], **({} if p["native"] else {"deepspeed_files": False})},
        )
        p["stall"] += time.perf_counter() - t0
        if self.log is not None:  # at the current step (wandb's steps only increase); stall_s: the loop's stall
            self.log.log(
                self.now,
                {
                    "saved_step": p["step"],
                    "stall_s": p["stall"],
                    "async": 1,
                    "write_s": time.perf_counter() - p["started"],
                },
                "checkpoint",
                echo=False,
            )
        return time.perf_counter() - t0

    def close(self, abort: bool) -> None:
        """Finish the pending save (``abort``: kill its writers, leaving ``step_N.tmp`` for the next
        start to remove) and stop the results manager."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        try:
            if abort:
                self.queue.abort()
            else:
                self.finish(blocking=True)
        finally:
            self.pending = None
            filesystem_async._results_queue = None
            self.warm.join()
            self.manager.shutdown()

    # ------------------------------------------------------------------ the run's saver (checkpoint.Saver's)

    def checkpoint(self, run, step: int, wait: bool) -> None:
        """Collective: start the save of ``step`` (``wait``: finished before returning)."""
        self.save(run.engine, step, run.consumed(step), wait)

    def poll(self, run) -> None:
        """Collective, every step: publish the pending save if every rank's writer is done."""
        self.now = run.step
        self.finish(blocking=False)

    def flush(self) -> None:
        """Collective: publish the pending save (waiting for its writers)."""
        self.finish(blocking=True)


class _Hook(Hook):
    """``train.async_save`` in the training loop: the writer is the run's saver (``run.saver``); at the end
    of a run (its last save was waited for) or after an error (the writers are killed) it stops."""

    def start(self, run) -> None:
        run.saver = self.saver = AsyncSaver(run.cfg, run.log, run.hooks)

    def close(self, run, status: int | None) -> None:
        saver, self.saver = getattr(self, "saver", None), None
        if saver is not None:
            saver.close(abort=True)


def hook(run) -> _Hook | None:
    return _Hook() if run.cfg.train.async_save else None
