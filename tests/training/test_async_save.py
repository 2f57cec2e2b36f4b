"""``train.async_save`` (issue 35 item 1, megahash/training/async_save.py) through the real DeepSpeed
engine on one CPU rank: training goes on while a checkpoint is written in the background; ``latest``
and the manifest name the previous checkpoint until the writer has finished; a kill -9 mid-write
leaves that previous checkpoint as the resume point; ``train.keep_last`` keeps it meanwhile; the save
of a stop is finished before the process exits; the async checkpoints (no DeepSpeed-native files)
resume bit-exactly. The runs that are killed or fail are processes of their own (forked from the test fork
server, conftest.popen); the resumes run in this one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launch import wait_for_step

import conftest
from conftest import ROOT, popen, pretrain_here

TINY = [*conftest.TINY, "train.eval_interval=0", "train.async_save=true", "train.save_interval=2", "train.keep_last=1"]


def _args(shards, run_dir: Path, *extra) -> list[str]:
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        "train.steps=6",
        f"train.save_dir={run_dir}",
        *extra,
    ]


def _trainer(args: list[str], where: Path, delay: str):
    """``python megahash/pretrain.py ARGS`` as a process of its own, in the folder ``where`` (made here): the
    trainer's forks (its background writers) inherit that working folder, which is how _survivors finds them
    (a forked process's command line is the fork server's). ``delay``: MEGAHASH_TEST_ASYNC_WRITE_DELAY."""
    where.mkdir()
    return popen(
        [sys.executable, str(ROOT / "megahash" / "pretrain.py"), *args],
        subprocess.PIPE,
        subprocess.PIPE,
        cwd=where,
        MEGAHASH_TEST_ASYNC_WRITE_DELAY=delay,
    )


def _wait_for_step(run_dir: Path, step: int, proc, timeout: float = 900) -> None:
    wait_for_step(run_dir, step, lambda: proc.poll() is None, timeout)


@pytest.mark.slow
def test_kill_during_async_write_resumes_from_the_previous_checkpoint_bit_exactly(shakespeare_shards, tmp_path):
    """6 steps saving every 2 with the writer of step 4 held for a minute: steps 5 and 6 train while
    it writes (``latest`` still step 2, ``step_00000004.tmp`` unpublished, step 2 not pruned by
    keep_last=1); kill -9 then. The rerun resumes from step 2, stops after step 4 (its save finished
    before exit, DeepSpeed's native files absent, step 2 pruned), and a third run resumes from step 4:
    steps 3-6 equal the killed run's bit for bit (loss and gradient norm)."""
    from megahash.checkpoint.manifest import damage

    run_dir, where = tmp_path / "run", tmp_path / "trainer"
    proc = _trainer(_args(shakespeare_shards, run_dir), where, "4:120")
    try:
        _wait_for_step(run_dir, 6, proc)  # the last step waits for the held writer of step 4
        assert (run_dir / "latest").read_text() == "step_00000002"
        assert (run_dir / "step_00000004.tmp" / "model").is_dir() and not (run_dir / "step_00000004").exists()
        assert damage(run_dir / "step_00000002") is None  # complete, manifest-verified, not pruned
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert _survivors(where) == []  # the held writer died with the trainer (no orphan writes into step 4)
    killed = {s: rec for s, rec in _records(run_dir).items()}
    assert sorted(killed) == [1, 2, 3, 4, 5, 6]

    r = pretrain_here(_args(shakespeare_shards, run_dir, "train.stop_after=4"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir}/step_00000002" in r.stdout and "stopped at step 4" in r.stdout
    assert (run_dir / "latest").read_text() == "step_00000004" and damage(run_dir / "step_00000004") is None
    assert not (run_dir / "step_00000002").exists() and not (run_dir / "step_00000004.tmp").exists()
    assert not list((run_dir / "step_00000004").glob("*.pt"))  # no DeepSpeed-native copy
    assert json.loads((run_dir / "step_00000004" / "megahash_state.json").read_text())["deepspeed_files"] is False

    r = pretrain_here(_args(shakespeare_shards, run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir}/step_00000004" in r.stdout
    resumed = _records(run_dir)  # the last record of a step wins
    # bit-exact: resuming is the promise (one machine, one code path)
    assert {s: resumed[s] for s in (3, 4, 5, 6)} == {s: killed[s] for s in (3, 4, 5, 6)}
    saves = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"checkpoint"' in l]
    assert [rec["saved_step"] for rec in saves] == [2, 4, 6] and all(rec["async"] == 1 for rec in saves)


def _survivors(where: Path, wait: float = 10.0) -> list[int]:
    """Processes working in the trainer's folder ``where`` (the trainer's forks: writers, file writers) still
    alive after ``wait`` seconds: none may outlive a killed or failed trainer."""
    deadline = time.time() + wait
    while True:
        alive = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and Path(os.readlink(d / "cwd")) == where.resolve():
                    alive.append(int(d.name))
            except OSError:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _records(run_dir: Path) -> dict[int, tuple]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            out[rec["step"]] = (rec["loss"], rec["grad_norm"])
    return out


def test_a_failed_background_write_is_one_line_and_keeps_the_previous_checkpoint(shakespeare_shards, tmp_path):
    """The folder of step 4's save disappears while its writer is held (5 s): the run's last save fails on
    publication with one line naming the file, exit 2, ``step_00000004.tmp`` removed, ``latest`` still
    step 2 (megahash/training/checkpoint_faults.py's message and remedy, as a synchronous save's)."""
    import shutil

    run_dir, where = tmp_path / "run", tmp_path / "trainer"
    proc = _trainer([*_args(shakespeare_shards, run_dir), "train.steps=4"], where, "4:5")
    try:
        _wait_for_step(run_dir, 4, proc)
        deadline = time.time() + 60
        while not (run_dir / "step_00000004.tmp" / "optimizer").is_dir() and time.time() < deadline:
            time.sleep(0.05)
        shutil.rmtree(run_dir / "step_00000004.tmp" / "model")
        _out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, err[-3000:]
    assert _survivors(where) == []  # the killed writer's file writers died with it (they used to hang)
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "No such file or directory" in lines[0], err[-3000:]
    assert "the previous checkpoint step_00000002 is intact" in lines[0] and "fix the folder" in lines[0]
    assert (run_dir / "latest").read_text() == "step_00000002" and not (run_dir / "step_00000004.tmp").exists()
    from test_integrity import assert_digests

    assert_digests(run_dir / "step_00000002")  # hashed by the background writers (docs/security.md)


def test_a_partial_save_is_removed_while_a_dying_writer_still_adds_files(tmp_path):
    """checkpoint._abandon (the failure path of every save): a killed background writer's file writers die a
    moment after it, and a file one of them creates while the folder is being removed made a single
    ``rmtree(ignore_errors=True)`` leave ``step_N.tmp`` behind (CI, under load). A thread creating files in
    the folder for half a second stands in for them: the folder is gone afterwards."""
    import threading

    from megahash.training import checkpoint

    tmp = tmp_path / "step_00000004.tmp"
    (tmp / "model").mkdir(parents=True)
    started, until = threading.Event(), time.monotonic() + 0.5

    def dying_writer():
        i = 0
        while time.monotonic() < until:
            try:
                (tmp / "model" / f"__{i}_0.distcp").write_bytes(b"x" * 4096)
            except OSError:  # the folder is gone: a writer's open fails (it makes no folders)
                pass
            i += 1
            started.set()

    t = threading.Thread(target=dying_writer)
    t.start()
    started.wait(10)
    try:
        checkpoint._abandon(tmp)
    finally:
        t.join()
    assert not tmp.exists()


@pytest.mark.usefixtures("dist")
def test_the_writer_reads_a_private_copy_of_memory_it_shares(tmp_path, monkeypatch):
    """A forked writer's snapshot is copy-on-write only for private memory. megatron's preload puts a GPU's
    tensors in pinned memory, which the driver maps shared with the writer, and the parent's next save reused
    those pages while the writer read them (async_save.private_copies). Shared CPU memory is the same hazard
    without a GPU: the parent overwrites its tensor at once, the writer (made to wait 0.5 s) must still write
    the values of the moment of the save."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megahash.training import async_save

    monkeypatch.setenv(async_save.DELAY_ENV, "0:0.5")
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start()
    try:
        queue = async_save._Queue(manager)
        want = torch.arange(4096, dtype=torch.float32)
        w = want.clone().share_memory_()
        (tmp_path / "ckpt").mkdir()
        queue.save({"w": ShardedTensor.from_rank_offsets("w", w, replica_id=0)}, tmp_path / "ckpt")
        w.fill_(-1.0)  # the parent goes on (its next preload into the same pages)
        queue.calls.maybe_finalize_async_calls(blocking=True)
        template = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4096), replica_id=0)}
        got = dist_checkpointing.load(template, str(tmp_path / "ckpt"))["w"]
    finally:
        manager.shutdown()
    assert torch.equal(got, want)  # bit-exact: a checkpoint holds the bytes of the moment it was saved
