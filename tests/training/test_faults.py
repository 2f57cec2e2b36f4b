"""Faults (issue 14): damaged inputs refused before step 1, checkpoint faults, signals, elastic resume.

Damaged inputs run in-process through the pretrain entry point (a 1-rank gloo world): each case is
one damaged copy of the real Shakespeare shards (symlinks to the intact files), exit status 2, one
``error:`` line naming the file, nothing written under ``train.save_dir``. One-rank runs are in this
process (conftest.pretrain_here), 2-rank ones in rank processes without a launcher (conftest.pretrain_group),
but where a launcher and its signals are what is tested."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY


def base(shards, save_dir, steps, *extra, prefix=None):
    return [
        f"data.prefix=[{prefix or shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"train.steps={steps}",
        f"train.save_dir={save_dir}",
        *extra,
    ]


def _foreign_shard(path_prefix: str, docs: int, dtype, width: int = 1) -> None:
    """A shard written by the data stage's writer from other documents (another build)."""
    from megahash.data.preprocess.indexed_writer import IndexedShardWriter

    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 50, size=docs) * width
    w = IndexedShardWriter(path_prefix + ".bin", path_prefix + ".idx", dtype)
    w.add_documents(rng.integers(5, 200, size=int(lengths.sum())), lengths)
    w.finalize()


def _truncate(p: Path, keep: float = 0.5) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def _flip(p: Path) -> None:  # same size, other content: only the checksum sees it
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _foreign_side_with_sizes_in_meta(d: Path) -> None:
    """A side shard of another document count whose sizes were also copied into the meta (only the
    index header/count checks can tell)."""
    _foreign_shard(str(d / "shakespeare_hash_md5"), 37, np.uint8, 16)
    meta_path = d / "shakespeare_meta.json"
    meta = json.loads(meta_path.read_text())
    for ext in (".bin", ".idx"):
        meta["files"]["shakespeare_hash_md5" + ext]["bytes"] = (d / f"shakespeare_hash_md5{ext}").stat().st_size
    meta_path.write_text(json.dumps(meta))


DAMAGE = {
    "truncated_token_bin": (
        lambda d: _truncate(d / "shakespeare_text_document.bin"),
        [],
        "shakespeare_text_document.bin",
    ),
    "truncated_token_idx": (
        lambda d: _truncate(d / "shakespeare_text_document.idx", 0.9),
        [],
        "shakespeare_text_document.idx",
    ),
    "foreign_token_bin": (
        lambda d: _foreign_shard(str(d / "shakespeare_text_document"), 400, np.uint16),
        [],
        "shakespeare_text_document",
    ),
    "foreign_side_shard_doc_count": (
        lambda d: _foreign_shard(str(d / "shakespeare_hash_md5"), 37, np.uint8, 16),
        [],
        "shakespeare_hash_md5",
    ),
    "foreign_side_shard_meta_sizes": (
        _foreign_side_with_sizes_in_meta,
        [],
        ("shakespeare_hash_md5", "shakespeare_meta"),
    ),
    "foreign_idx_same_size_bin": (
        lambda d: _flip(d / "shakespeare_hash_lsh128.idx"),
        [],
        "shakespeare_hash_lsh128.idx",
    ),
    "flipped_bin_byte_full_verify": (
        lambda d: _flip(d / "shakespeare_hash_md5.bin"),
        ["data.verify=full"],
        "shakespeare_hash_md5.bin",
    ),
    "missing_meta": (lambda d: (d / "shakespeare_meta.json").unlink(), [], "shakespeare_meta.json"),
    "corrupt_meta": (
        lambda d: (d / "shakespeare_meta.json").write_text('{"format_version": 1,'),
        [],
        "shakespeare_meta.json",
    ),
    "meta_of_another_format": (  # named no fix before
        lambda d: (d / "shakespeare_meta.json").write_text(
            json.dumps({**json.loads((d / "shakespeare_meta.json").read_text()), "format_version": 9})
        ),
        [],
        "shakespeare_meta.json",
    ),
    "meta_not_an_object": (lambda d: (d / "shakespeare_meta.json").write_text("[]"), [], "shakespeare_meta.json"),
    "misshapen_meta_record": (  # valid JSON, a record of another shape (tests/data: every record)
        lambda d: (d / "shakespeare_meta.json").write_text(
            json.dumps({**json.loads((d / "shakespeare_meta.json").read_text()), "stream": ["subword"]})
        ),
        [],
        "shakespeare_meta.json",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_input_refused_before_step_1(shakespeare_shards, tmp_path, capsys, case):
    damage, extra, names = DAMAGE[case]
    names = (names,) if isinstance(names, str) else names
    src = Path(shakespeare_shards["prefix"]).parent
    d = tmp_path / "shards"
    d.mkdir()
    for p in src.iterdir():
        if p.name.startswith("shakespeare"):
            (d / p.name).symlink_to(p)
    for p in d.iterdir():  # the files a case damages become private copies
        if p.name.startswith(names):
            p.unlink()
            shutil.copy(src / p.name, p)
    damage(d)
    from megahash.pretrain import main

    save = tmp_path / "run"
    status = main(base(shakespeare_shards, save, 2, *extra, prefix=str(d / "shakespeare")))
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert status == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and any(n in err[0] for n in names), err
    assert "preprocess_data.py" in err[0]  # the fix
    assert not save.exists()


def test_intact_shards_pass_cheap_and_full(shakespeare_shards):
    from megahash.data.verify import verify_set

    for level in ("cheap", "full"):
        info = verify_set(shakespeare_shards["prefix"], level)
        assert info["side_shards"] == ["md5", "lsh128"] and info["documents"] > 0
    meta = json.loads(Path(shakespeare_shards["prefix"] + "_meta.json").read_text())
    assert info["checked_files"] == len(meta["files"]) and info["tokens"] == meta["counts"]["tokens"]


# -- checkpoint faults --------------------------------------------------------------------------
def test_damaged_newest_checkpoint_falls_back_and_dead_saves_are_cleaned(shakespeare_shards, tmp_path):
    """6 steps saving every 2; then the newest checkpoint is truncated, a newer step folder without a
    state file and leftovers of dead saves appear. The rerun (8 steps) warns about both damaged
    checkpoints, removes the leftovers, resumes from step 4 and repeats steps 5-6 bit-identically."""
    from conftest import pretrain_here, train_losses

    run_dir = tmp_path / "run"
    r = pretrain_here(
        base(shakespeare_shards, run_dir, 6, "train.save_interval=2", "train.eval_interval=0", "train.keep_last=0")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    first = train_losses(run_dir)
    step6 = (
        run_dir / "step_00000006"
    )  # optimizer state: ZeRO partition files, or (ZeRO-0 at one rank) the model states file
    optim = next(step6.glob("*optim_states.pt"), None) or next(step6.glob("*model_states.pt"))
    _truncate(optim, 0.6)
    (run_dir / "step_00000007" / "model").mkdir(parents=True)  # renamed but never finished (no state file)
    (run_dir / "step_00000008.tmp").mkdir()  # a save killed in flight
    (run_dir / "latest.tmp-4242").write_text("step_00000008")
    r = pretrain_here(
        base(shakespeare_shards, run_dir, 8, "train.save_interval=2", "train.eval_interval=0", "train.keep_last=0")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [l for l in r.stderr.splitlines() if l.startswith("warning: checkpoint")]
    assert len(warnings) == 2 and "step_00000007" in warnings[0] and "step_00000006" in warnings[1], warnings
    assert f"{optim.name} has" in warnings[1] and "resuming from the older step_00000004" in warnings[1]
    assert f"resumed from {run_dir}/step_00000004" in r.stdout
    assert not (run_dir / "step_00000008.tmp").exists() and not (run_dir / "latest.tmp-4242").exists()
    again = train_losses(run_dir)  # metrics.jsonl: the last record of a step wins
    # bit-exact: resume is the promise (same config and machine: one path)
    assert [again[s] for s in (5, 6)] == [first[s] for s in (5, 6)]
    assert (run_dir / "latest").read_text() == "step_00000008"
    from megahash.checkpoint.manifest import damage

    assert damage(run_dir / "step_00000008") is None and damage(run_dir / "step_00000006") is None  # re-saved


def test_only_damaged_checkpoints_is_one_line_not_a_fresh_start(tmp_path):
    from megahash.errors import CheckpointError
    from megahash.training.checkpoint import find_resume

    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "megahash_state.json").write_text('{"step": ')
    with pytest.raises(CheckpointError) as e:
        find_resume(tmp_path)
    assert "no intact checkpoint" in str(e.value) and "\n" not in str(e.value)


def test_disk_full_during_save_is_one_line_and_keeps_the_previous(shakespeare_shards, tmp_path):
    """A real full disk: the save folder is a tmpfs that holds one checkpoint but not two (sized from a
    checkpoint of the same run written elsewhere first)."""

    from conftest import pretrain_here, small_tmpfs

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    probe = tmp_path / "probe"
    r = pretrain_here(
        base(shakespeare_shards, probe, 2, "train.eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}")
    )
    assert r.returncode == 0, r.stderr[-3000:]
    one = sum(f.stat().st_size for f in probe.rglob("*") if f.is_file())  # one checkpoint + the run's logs
    with small_tmpfs(tmp_path / "small", f"{int(one * 1.6) // 1024 + 64}k") as mnt:
        run_dir = mnt / "run"
        r = pretrain_here(
            base(
                shakespeare_shards,
                run_dir,
                4,
                "train.save_interval=2",
                "train.eval_interval=0",
                f"data.cache_dir={tmp_path / 'cache'}",
            )
        )
        assert r.returncode == 2, r.stderr[-3000:]
        err = [l for l in r.stderr.strip().splitlines() if l.startswith("error:")]
        assert len(err) == 1 and "saving checkpoint step_00000004" in err[0] and "disk full" in err[0], r.stderr[-3000:]
        assert "Traceback" not in r.stderr
        assert "the previous checkpoint step_00000002 is intact" in err[0]
        assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
        assert (run_dir / "latest").read_text() == "step_00000002"
        assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
        from megahash.checkpoint.manifest import damage

        assert damage(run_dir / "step_00000002") is None


def test_a_full_disk_at_the_start_is_one_line_and_leaves_no_lock(shakespeare_shards, tmp_path):
    """A train.save_dir on a file system with no room left: the run lock was an OSError traceback (exit 1) and left an
    empty megahash.lock behind, which refused the rerun as "in use by another run (an unknown holder ...)" even after
    space was freed; with room for the lock alone, the resolved config was the traceback. Now one line naming the
    full disk each, exit 2, nothing left; with room again the run starts."""

    from conftest import pretrain_here, small_tmpfs

    with small_tmpfs(tmp_path / "full", "8m") as mnt:
        run_dir = mnt / "run"
        run_dir.mkdir()
        (mnt / "other_job").write_bytes(b"\0" * shutil.disk_usage(mnt).free)  # every block taken
        args = base(shakespeare_shards, run_dir, 1, "train.eval_interval=0", f"data.cache_dir={tmp_path / 'cache'}")
        r = pretrain_here(args)
        err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"cannot write train.save_dir {run_dir}" in err[0] and "disk full" in err[0], err
        assert list(run_dir.iterdir()) == []
        # room for the lock, not for the resolved config: that was an OSError traceback from save_config
        (mnt / "other_job").unlink()
        (mnt / "other_job").write_bytes(b"\0" * (shutil.disk_usage(mnt).free - 4096))
        r = pretrain_here(args)
        err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"cannot write the run's config and logs in {run_dir}" in err[0] and "disk full" in err[0], err
        assert not (run_dir / "megahash.lock").exists() and not list(run_dir.glob("step_*"))
        (mnt / "other_job").unlink()
        r = pretrain_here([*args, "train.save_interval=0", "train.steps=1"])
        assert "in use by another run" not in r.stderr, r.stderr[-3000:]
        assert "step 1/1" in r.stdout, r.stdout[-3000:]


def test_an_immutable_latest_says_the_checkpoint_was_saved(shakespeare_shards, tmp_path):
    """``latest`` made immutable (``chattr +i``: root's permission bits bypass read-only) fails the save after its
    checkpoint was renamed into place. Before, the line read "saving checkpoint step_00000004 ... failed ...
    nothing partial was kept, the previous checkpoint step_00000004 is intact" about the checkpoint it had just
    published; now it says that checkpoint is saved and complete, and names latest; the rerun resumes from it."""
    import subprocess

    from conftest import pretrain_here

    run_dir, cache = tmp_path / "run", f"data.cache_dir={tmp_path / 'cache'}"
    r = pretrain_here(base(shakespeare_shards, run_dir, 2, "train.eval_interval=0", cache))
    assert r.returncode == 0, r.stderr[-3000:]
    if os.geteuid() != 0 or subprocess.run(["chattr", "+i", str(run_dir / "latest")], capture_output=True).returncode:
        pytest.skip("chattr +i needs root and a file system that has the attribute")
    try:
        args = base(shakespeare_shards, run_dir, 6, "train.eval_interval=0", "train.save_interval=2", cache)
        r = pretrain_here(args)
    finally:
        subprocess.run(["chattr", "-i", str(run_dir / "latest")], capture_output=True)
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "checkpoint step_00000004" in err[0] and "is saved and complete" in err[0] and "latest" in err[0], err
    assert "failed" not in err[0] and "nothing partial" not in err[0]
    r = pretrain_here(args)
    assert r.returncode == 0 and f"resumed from {run_dir}/step_00000004" in r.stdout, r.stderr[-3000:]
    assert (run_dir / "latest").read_text() == "step_00000006"


@pytest.mark.multiprocess
def test_disk_full_while_logging_stops_every_rank_in_one_line(shakespeare_shards, tmp_path):
    """The disk fills between two saves (another job writes the rest of it): rank 0's next record of
    metrics.jsonl finds no room. Before, rank 0 died of an OSError traceback and rank 1 of gloo's "Connection
    closed by peer" in the next collective (exit 1, a record cut in half). Now every rank stops at that step's
    end, the save there fails for want of room too: one line naming the full disk, exit 2, the previous
    checkpoint intact, every record of the history whole; with room again the run resumes from it."""

    from conftest import pretrain_group, pretrain_here, small_tmpfs

    with small_tmpfs(tmp_path / "small", "32m") as mnt:
        run_dir, cache = mnt / "run", f"data.cache_dir={tmp_path / 'cache'}"
        r = pretrain_here(base(shakespeare_shards, run_dir, 2, "train.eval_interval=0", cache))  # step_00000002
        assert r.returncode == 0, r.stderr[-3000:]
        filler = mnt / "other_job"
        with open(filler, "wb") as f:  # all but 24 KiB: room for the run's start, then its history fills it
            f.write(b"\0" * (shutil.disk_usage(mnt).free - (24 << 10)))
        args = base(shakespeare_shards, run_dir, 400, "train.eval_interval=0", "train.save_interval=0", cache)
        (r,) = pretrain_group([args])
        assert r.returncode == 2, r.stderr[-3000:]
        err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert len(err) == 1 and "disk full" in err[0] and "the previous checkpoint step_00000002 is intact" in err[0]
        assert "Traceback" not in r.stderr and "Connection closed" not in r.stderr, r.stderr[-3000:]
        lines = (run_dir / "metrics.jsonl").read_bytes().split(b"\n")
        assert lines[-1] == b"" and all(json.loads(l) for l in lines[:-1])  # whole records only
        logged = max(json.loads(l)["step"] for l in lines[:-1])
        assert 2 < logged < 400
        assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
        from megahash.checkpoint.manifest import damage

        assert damage(run_dir / "step_00000002") is None
        filler.unlink()  # room again: the run goes on from its newest checkpoint
        r = pretrain_here(base(shakespeare_shards, run_dir, 4, "train.eval_interval=0", cache))
        assert r.returncode == 0 and f"resumed from {run_dir}/step_00000002" in r.stdout, r.stderr[-3000:]


def _payload_metadata(model_dir: Path, marker: Path) -> None:
    """Rewrite a real dist-checkpoint ``.metadata`` so that unpickling it runs a shell command."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = pickle.loads((model_dir / ".metadata").read_bytes())
    meta.storage_meta = Payload()
    (model_dir / ".metadata").write_bytes(pickle.dumps(meta))
    manifest = model_dir.parent / "manifest.json"  # a forger fixes the sizes too (sizes catch accidents only)
    m = json.loads(manifest.read_text())
    m["files"]["model/.metadata"] = (model_dir / ".metadata").stat().st_size
    manifest.write_text(json.dumps(m))


def test_export_hf_never_unpickles_code(shakespeare_shards, tmp_path):
    """The weights of a checkpoint load through a data-only unpickler: the real ``.metadata`` loads,
    one carrying a command is refused with one line, and the command never runs."""
    import io
    import pickle
    import sys

    from conftest import pretrain_here, run
    from megahash.checkpoint.safe_unpickle import RestrictedUnpickler
    from megahash.errors import CheckpointError

    run_dir = tmp_path / "run"
    r = pretrain_here(base(shakespeare_shards, run_dir, 1, "train.eval_interval=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    model_dir = run_dir / "step_00000001" / "model"
    real = (model_dir / ".metadata").read_bytes()
    assert RestrictedUnpickler(io.BytesIO(real)).load() is not None
    marker = tmp_path / "PWNED"
    _payload_metadata(model_dir, marker)
    with pytest.raises(CheckpointError):
        RestrictedUnpickler(io.BytesIO((model_dir / ".metadata").read_bytes())).load()
    assert not marker.exists()
    assert pickle.loads(real) is not None  # (plain pickle of the intact file works: the check is the only gate)
    r = run(
        [sys.executable, "-m", "megahash", "export-hf", "--checkpoint", str(run_dir), "--output", str(tmp_path / "hf")]
    )
    assert r.returncode == 2 and not marker.exists(), r.stderr[-3000:]
    err = [l for l in r.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(err) == 1 and "posix.system: refused" in err[0], r.stderr[-3000:]
    assert not (tmp_path / "hf").exists()


# -- stop signals under the real launchers -------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _rank_pid(root: int, rank: int) -> int:
    """The process under ``root`` whose environment says RANK=``rank`` (a rank the launcher started)."""
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"RANK={rank}".encode() in env and pid != root:
            return pid
        todo += _children(pid)
    raise AssertionError(f"no process of rank {rank} under {root}")


def _launch_and_signal(
    launcher: str, args: list[str], run_dir: Path, kill_at: int, target: str, sig, after_save: int = 0
):
    """Start 2 ranks with ``python -m launch --launcher LAUNCHER --nproc-per-node 2`` (deepspeed or
    torchrun under launch/supervise.py) in their own process group. Once step ``kill_at`` is logged
    (and checkpoint ``after_save`` is complete), send ``sig`` to ``target``: "group" = the whole
    process group (what scancel, a time limit and most schedulers do), "launcher" = the deepspeed
    runner or the torchrun agent process alone. Returns (exit status, output)."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT, _free_port, child_env, train_losses

    cmd = [
        sys.executable,
        "-m",
        "launch",
        "--launcher",
        launcher,
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        *args,
    ]
    p = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline, read = time.time() + 300, -1  # read: the size of metrics.jsonl when it was last parsed
        while time.time() < deadline and p.poll() is None:
            if not after_save or (run_dir / f"step_{after_save:08d}" / "megahash_state.json").is_file():
                try:
                    size = (run_dir / "metrics.jsonl").stat().st_size
                    if size != read:  # parsed again only when it grew (a poll every 20 ms for a minute)
                        read = size
                        if max(train_losses(run_dir), default=0) >= kill_at:
                            break
                except (OSError, ValueError):
                    pass
            time.sleep(0.02)
        if p.poll() is not None:  # its output says why (one CI run's resumed piece exited 1 before its first step)
            out, _ = p.communicate(timeout=60)
            raise AssertionError(f"{launcher} run ended before step {kill_at} (exit {p.returncode})\n{out[-4000:]}")
        if target == "group":
            os.killpg(p.pid, sig)
        elif target == "rank1":  # the rank process alone (the out-of-memory killer's choice)
            os.kill(_rank_pid(p.pid, 1), sig)
        else:  # python -m launch exec'd the supervisor; its one child is the launcher
            (child,) = _children(p.pid)
            os.kill(child, sig)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_stop_signals_under_deepspeed_and_torchrun_resume_bit_exactly(shakespeare_shards, tmp_path):
    """2 ranks, a periodic save every 4 steps, one run in 5 pieces under the real launchers (through
    `python -m launch`, i.e. launch/supervise.py): SIGTERM to the deepspeed launcher's whole process
    group after a periodic save; SIGUSR1 to the torchrun agent alone; SIGUSR1 to the deepspeed runner
    alone; SIGTERM to torchrun's process group after a periodic save; SIGTERM to the deepspeed runner
    alone. Every stop checkpoints all ranks at one step boundary (no step_N.tmp left, the helpers of
    a save survive), the command exits with the requeue status 3, the next piece resumes from that
    checkpoint, and the losses of the pieces equal the uninterrupted run's bit for bit. (SIGTERM to
    the torchrun agent alone takes the agent's path of SIGUSR1: both are in its handled signals.)"""
    import re
    import signal

    from conftest import pretrain_group, train_losses

    steps = 40
    common = ["train.save_interval=4", "train.eval_interval=0", "train.keep_last=0"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    # the reference saves only at its end: periodic saves must not change a run's losses either (its 2 ranks
    # without a launcher: the launchers are the pieces' part)
    (r,) = pretrain_group([base(shakespeare_shards, straight, steps, "train.save_interval=0", "train.eval_interval=0")])
    assert r.returncode == 0, r.stderr[-3000:]
    pieces = [
        ("deepspeed", "group", signal.SIGTERM),
        ("torchrun", "launcher", signal.SIGUSR1),
        ("deepspeed", "launcher", signal.SIGUSR1),
        ("torchrun", "group", signal.SIGTERM),
        ("deepspeed", "launcher", signal.SIGTERM),
    ]
    stop = 0
    for launcher, target, sig in pieces:
        after_save = (stop // 4 + 1) * 4 if target == "group" else 0  # the helpers of a save in this piece
        kill_at = max(after_save, stop) + 1
        status, out = _launch_and_signal(
            launcher, base(shakespeare_shards, split, steps, *common), split, kill_at, target, sig, after_save
        )
        what = f"{launcher} {target} {sig.name}"
        assert not stop or f"resumed from {split}/step_{stop:08d}" in out, f"{what}\n{out[-4000:]}"
        # the deepspeed runner dies of a signal sent to it alone: launch/supervise.py then sends SIGUSR1
        want = signal.SIGUSR1 if (launcher, target) == ("deepspeed", "launcher") else sig
        m = re.search(rf"stopped at step (\d+) \(signal {int(want)}\); checkpoint saved", out)
        assert m and status == 3, f"{what}: exit {status}\n{out[-4000:]}"
        new_stop = int(m.group(1))
        assert new_stop >= kill_at and (split / "latest").read_text() == f"step_{new_stop:08d}", out[-3000:]
        assert "BrokenPipeError" not in out and "Traceback (most recent call last)" not in out.split("stopped at")[0]
        assert not list(split.glob("*.tmp")), what
        assert not (split / "megahash.lock").exists(), what  # rank 0 released the run's lock (docs/security.md)
        state = json.loads((split / f"step_{new_stop:08d}" / "megahash_state.json").read_text())
        assert state["step"] == new_stop and state["world_size"] == 2
        stop = new_stop
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == list(range(1, steps + 1)) and sorted(b) == list(range(1, stop + 1))
    # bit-exact: resume after a signal is the promise (same ranks, OMP_NUM_THREADS=1, same machine)
    assert [a[s] for s in range(1, stop + 1)] == [b[s] for s in range(1, stop + 1)]


# -- interrupted preprocess -----------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_to_a_torchrun_group_checkpoints_like_sigterm(shakespeare_shards, tmp_path):
    """SIGINT (Ctrl-C in the terminal) to the whole process group of a torchrun launch: torchrun's agent forwards
    it to the ranks as SIGINT. Before, a KeyboardInterrupt traceback on every rank, exit 1, and the steps since the
    last periodic checkpoint lost (deepspeed's launcher sends SIGTERM, so there it checkpointed). Now it is a stop
    signal like SIGTERM: the ranks checkpoint the step they are at, and the launch exits 3 (requeue)."""
    import re
    import signal

    run_dir = tmp_path / "run"
    args = base(shakespeare_shards, run_dir, 400, "train.eval_interval=0", "train.save_interval=5")
    status, out = _launch_and_signal("torchrun", args, run_dir, 6, "group", signal.SIGINT, after_save=5)
    m = re.search(r"stopped at step (\d+) \(signal 2\); checkpoint saved", out)
    assert m and status == 3, f"exit {status}\n{out[-4000:]}"
    assert (run_dir / "latest").read_text() == f"step_{int(m.group(1)):08d}" and int(m.group(1)) >= 6
    assert "KeyboardInterrupt" not in out and not list(run_dir.glob("*.tmp")), out[-4000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_rank_leaves_one_line_on_the_others_and_the_newest_checkpoint(shakespeare_shards, tmp_path):
    """SIGKILL to rank 1 alone (the out-of-memory killer's way) in the middle of a 2-rank run under deepspeed:
    rank 0's next collective fails. Before, gloo's RuntimeError ("Connection reset/closed by peer ... GLHF")
    traceback and exit 1; now one line on rank 0 saying another rank is gone and how to resume, exit 2 through
    the supervisor, and the newest complete checkpoint is the one a rerun resumes from."""
    import signal
    import sys

    run_dir = tmp_path / "run"
    args = base(shakespeare_shards, run_dir, 400, "train.eval_interval=0", "train.save_interval=2")
    status, out = _launch_and_signal("deepspeed", args, run_dir, 3, "rank1", signal.SIGKILL, after_save=2)
    err = [l for l in out.splitlines() if l.startswith("error:")]
    assert status == 2 and len(err) == 1, f"exit {status}\n{out[-4000:]}"
    assert "rank 0 stopped: another rank's process is gone" in err[0] and "train.resume=auto" in err[0]
    assert "Traceback" not in out and "GLHF" not in out.replace(err[0], ""), out[-4000:]
    from megahash.checkpoint.resolve import choose_resume

    newest = choose_resume(run_dir, warn=False, level="full")
    assert newest is not None and newest.name >= "step_00000002"
    assert sys.platform != "linux" or not _rank_pids_left(run_dir)


def _rank_pids_left(run_dir: Path) -> list[int]:
    """Processes still running with ``run_dir`` on their command line (orphaned ranks)."""
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir).encode() in cmdline.read_bytes():
                left.append(int(cmdline.parent.name))
        except OSError:
            continue
    return left


def _preprocess_cmd(shards, prefix, *extra):
    import sys

    return [
        sys.executable,
        "data_tools/preprocess_data.py",
        "--input",
        "shakespeare",
        "--output-prefix",
        str(prefix),
        "--tokenizer",
        shards["tokenizer"],
        "--word-hashes",
        "md5,lsh128",
        "--quiet",
        *extra,
    ]


def test_killed_preprocess_takes_its_workers_along(shakespeare_shards, tmp_path):
    """SIGKILL to the main process of a 2-worker preprocess: the workers exit too (they used to keep
    running), and nothing is published under the prefix."""
    import signal
    import subprocess
    import time

    from test_launch import descendants

    from conftest import ROOT, child_env

    prefix = tmp_path / "shk"
    p = subprocess.Popen(
        _preprocess_cmd(shakespeare_shards, prefix, "--workers", "2"),
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        workers = []
        while time.time() < deadline and p.poll() is None and len(workers) < 2:
            workers = [w for w in descendants([p.pid]) if w != p.pid]
            time.sleep(0.05)
        assert len(workers) >= 2 and p.poll() is None, p.stderr.read() if p.poll() is not None else workers
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.time() + 30
        while time.time() < deadline and any(Path(f"/proc/{w}").exists() and "Z" not in _state(w) for w in workers):
            time.sleep(0.1)
        assert not [w for w in workers if Path(f"/proc/{w}").exists() and "Z" not in _state(w)], "workers survived"
    finally:
        if p.poll() is None:
            p.kill()
    assert not Path(str(prefix) + "_meta.json").exists()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_set_without_meta_is_refused_and_rerun_needs_no_overwrite(shakespeare_shards, tmp_path):
    """A kill during the final renames leaves shards without their meta (and a temp file): readers
    refuse the set in one line; the same command rerun without --overwrite rebuilds it, byte for byte."""
    import subprocess

    from conftest import ROOT, child_env
    from megahash.data.verify import sha256_file
    from megahash.errors import DataError

    prefix = tmp_path / "shk"
    cmd = _preprocess_cmd(shakespeare_shards, prefix, "--workers", "1", "--max-docs", "60")
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = json.loads(Path(str(prefix) + "_meta.json").read_text())
    # what a kill between the renames leaves: some shards published, one still a temp file, no meta
    Path(str(prefix) + "_meta.json").unlink()
    os.replace(str(prefix) + "_hash_md5.bin", str(prefix) + "_hash_md5.bin.tmp-999999")
    from megahash.data.shards import ShardSet

    with pytest.raises(DataError) as e:
        ShardSet.open(str(prefix))
    assert "no shk_meta.json: it is incomplete" in str(e.value) and "\n" not in str(e.value)
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    again = json.loads(Path(str(prefix) + "_meta.json").read_text())
    assert again["files"] == meta["files"]
    for name, info in meta["files"].items():
        assert sha256_file(str(tmp_path / name)) == info["sha256"]
    assert not list(tmp_path.glob("*.tmp-*"))
    # a complete set still needs --overwrite
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--overwrite" in r.stderr


# -- another layout -----------------------------------------------------------------------------
def _as_older_megahash(ckpt: Path, dest: Path) -> None:
    """A copy of ``ckpt`` as megahash wrote it before optimizer state was saved per parameter
    (no ``optimizer/``, and no manifest entries for it)."""
    shutil.copytree(ckpt, dest)
    shutil.rmtree(dest / "optimizer")
    manifest = dest / "manifest.json"
    m = json.loads(manifest.read_text())
    m["files"] = {k: v for k, v in m["files"].items() if not k.startswith("optimizer/")}
    manifest.write_text(json.dumps(m))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_layout_change_carries_optimizer_state_and_the_data_order(shakespeare_shards, tmp_path, capsys):
    """2 ranks ZeRO-1 -> 1 rank ZeRO-3 -> 2 ranks TP=2 (ZeRO-0 at one DP rank), every resume WITHOUT
    train.resume_weights_only: each continues from the saved step, every checkpoint's consumed
    samples are step x global batch (the same global samples at any DP size), and every resumed
    step's loss is the uninterrupted run's to 1e-4 (TOL; measured at most 2.4e-7): the first because
    the weights came along, the later ones because Adam's moments and step count did too. A
    weights-only resume of the same checkpoint (fresh Adam) is more than 10 x TOL off from its second
    step on (measured 1.0e-2, 2.3e-2). A checkpoint without movable optimizer state (an older
    megahash's) at another layout is one line before DeepSpeed loads anything."""
    from conftest import pretrain_group, pretrain_here, train_losses
    from megahash.pretrain import main

    steps, gbs, TOL = 12, 8, 1e-4
    common = ["train.eval_interval=0", "train.keep_last=0"]
    straight, split, fresh, old = tmp_path / "straight", tmp_path / "split", tmp_path / "fresh", tmp_path / "old"
    runs = pretrain_group(
        [
            base(shakespeare_shards, split, steps, *common, "train.zero_stage=1", "train.stop_after=4"),
            base(shakespeare_shards, straight, steps, *common, "train.zero_stage=1"),
        ]
    )
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((split / "step_00000004" / "optimizer" / "megahash_optimizer.json").read_text())
    assert info["complete"] and info["adam_step"] == 4 and info["keys"] == ["exp_avg", "exp_avg_sq"], info
    manifest = json.loads((split / "step_00000004" / "manifest.json").read_text())["files"]
    assert "optimizer/megahash_optimizer.json" in manifest and any(
        k.endswith(".distcp") and k.startswith("optimizer/") for k in manifest
    )
    _as_older_megahash(split / "step_00000004", old / "step_00000004")
    before = sorted(p.name for p in old.rglob("*"))
    status = main(base(shakespeare_shards, old, steps, *common, "train.zero_stage=3", "train.stop_after=8"))
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.startswith("error:")]
    assert status == 2 and len(err) == 1, err
    assert "data parallel 2 -> 1, zero stage 1 -> 3" in err[0] and "train.resume_weights_only=true" in err[0]
    assert "no optimizer/megahash_optimizer.json (saved by an older megahash)" in err[0], err[0]
    assert sorted(p.name for p in old.rglob("*")) == before  # nothing written
    # the ZeRO-3 leg runs one step past its checkpoint at 8, so the TP=2 leg's first step has a reference
    r = pretrain_here(
        base(
            shakespeare_shards,
            split,
            steps,
            *common,
            "train.zero_stage=3",
            "train.stop_after=9",
            "train.save_interval=8",
        )
    )
    assert r.returncode == 0 and f"resumed from {split}/step_00000004" in r.stdout, r.stderr[-3000:]
    leg2 = train_losses(split)
    (r,) = pretrain_group(
        [
            base(
                shakespeare_shards,
                split,
                steps,
                *common,
                "train.zero_stage=1",
                "parallel.tensor=2",
                f"train.resume={split / 'step_00000008'}",
            )
        ]
    )
    assert r.returncode == 0 and f"resumed from {split}/step_00000008" in r.stdout, r.stderr[-3000:]
    r = pretrain_here(
        base(
            shakespeare_shards,
            fresh,
            steps,
            *common,
            "train.zero_stage=3",
            "train.stop_after=7",
            "train.resume_weights_only=true",
            f"train.resume={split / 'step_00000004'}",
        )
    )
    assert r.returncode == 0 and f"resumed from {split}/step_00000004" in r.stdout, r.stderr[-3000:]
    a, b, w = train_losses(straight), train_losses(split), train_losses(fresh)
    assert sorted(b) == list(range(1, steps + 1)) and sorted(w) == [5, 6, 7]
    # bit-exact: steps 1-4 are the same 2-rank ZeRO-1 run in both (one path); the other layouts after: TOL
    assert [a[s] for s in range(1, 5)] == [b[s] for s in range(1, 5)]
    off = {s: abs(a[s] - b[s]) for s in range(5, steps + 1)}
    off[9] = max(off[9], abs(leg2[9] - a[9]))  # ZeRO-3's own step 9 and TP=2's first step (both from step 8)
    fresh_off = {s: abs(a[s] - w[s]) for s in w}
    assert max(off.values()) < TOL and abs(leg2[9] - b[9]) < TOL, off  # same weights, Adam state, samples
    assert fresh_off[5] < 1e-4 and min(fresh_off[6], fresh_off[7]) > 10 * TOL, fresh_off  # a fresh Adam does not
    for step, (world, zero, tp) in {4: (2, 1, 1), 8: (1, 3, 1), 9: (1, 3, 1), 12: (2, 1, 2)}.items():
        st = json.loads((split / f"step_{step:08d}" / "megahash_state.json").read_text())
        assert st["consumed_samples"] == step * gbs and st["world_size"] == world and st["zero_stage"] == zero
        assert st["signature"]["tensor_parallel"] == tp
        assert (
            json.loads((split / f"step_{step:08d}" / "optimizer" / "megahash_optimizer.json").read_text())["adam_step"]
            == step
        )
