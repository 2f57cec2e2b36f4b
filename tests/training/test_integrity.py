"""Checkpoint integrity, one run per save_dir, one history after a resume (issue 47 items 2, 3, 7).

One straight run (8 steps, a checkpoint every 2, one rank in this process) is made once; each test
damages a copy of it. Facts checked: the manifest's sha256 equals hashlib's over each file; a byte
flipped in a weights file (same size) is found and the resume falls back to the older checkpoint,
whose continuation equals the straight run's losses bit for bit (resume is bit-exact at one layout);
a checkpoint without a manifest that is truncated, or whose pickle does not load, falls back the same
way; nothing intact is one line, exit 2; eval and export refuse a damaged checkpoint in one line. The
lock of ``train.save_dir`` is tested on real runs (a second run refused while the first is stopped,
``pretrain.py --check`` beside it, the lock gone after SIGTERM to the first run's process group, a
killed run's lock reclaimed by the next) and on forged holders."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, TINIER, child_env, train_losses

TINY = [
    *TINIER,  # hidden 32, one layer, ZeRO-0, every step logged, checkpoints kept
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=2e-3",
    "train.warmup_steps=2",
    "train.save_interval=2",
]


def _args(shards, run_dir: Path, steps: int, *extra) -> list[str]:
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"train.steps={steps}",
        f"train.save_dir={run_dir}",
        *extra,
    ]


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    from megahash.pretrain import main

    status = main(args)
    cap = capsys.readouterr()
    return status, cap.out, cap.err


@pytest.fixture(scope="module")
def straight(shakespeare_shards, tmp_path_factory) -> Path:
    """8 steps straight, checkpoints at steps 2, 4, 6, 8 (in this process)."""
    from megahash.pretrain import main

    run_dir = tmp_path_factory.mktemp("integrity") / "straight"
    assert main(_args(shakespeare_shards, run_dir, 8)) == 0
    return run_dir


def _copy(run_dir: Path, dest: Path, keep=("step_00000002", "step_00000004", "step_00000006")) -> Path:
    """A copy of the straight run with the checkpoints ``keep`` (its metrics.jsonl with the records up to
    the newest of them, as the run that wrote them would have left it)."""
    shutil.copytree(
        run_dir, dest, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n not in keep]
    )
    last = int(max(keep)[len("step_") :])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= last))
    return dest


def _flip(p: Path, at: float = 0.5) -> None:
    """One byte of ``p`` inverted at the fraction ``at`` of its length: same size, other content."""
    data = bytearray(p.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    p.write_bytes(bytes(data))


def _warnings(err: str) -> list[str]:
    return [l for l in err.splitlines() if l.startswith("warning: checkpoint")]


def assert_digests(ckpt: Path) -> None:
    """Every file of ``ckpt`` is in its manifest with hashlib's sha256 of its bytes (computed here,
    independently), and no sidecar of the ranks' digests is left behind."""
    from megahash.checkpoint.manifest import damage

    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {
        str(p.relative_to(ckpt))
        for p in ckpt.rglob("*")
        if p.is_file()
        and p.name not in ("manifest.json", "megahash_state.json", "manifest.sig")  # sig: of the manifest
    }
    assert set(files) == on_disk and any(k.startswith("model/") for k in files), ckpt
    for rel, entry in files.items():
        data = (ckpt / rel).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert damage(ckpt, "full") is None


def test_manifest_holds_the_sha256_of_every_file(straight):
    for ckpt in sorted(straight.glob("step_*")):
        assert_digests(ckpt)


def test_a_flipped_byte_is_found_and_the_resume_falls_back(straight, shakespeare_shards, tmp_path, capsys):
    """A byte of step 6's DeepSpeed weights file flipped (same size, the zip still readable): sizes and
    structure (``cheap``) pass it, the sha256 (``full``, the default) does not; the rerun warns in one
    line, resumes from step 4 and its steps 5-8 are the straight run's, bit for bit."""
    from megahash.checkpoint.manifest import damage

    run_dir = _copy(straight, tmp_path / "run")
    weights = run_dir / "step_00000006" / "mp_rank_00_model_states.pt"
    _flip(weights, 0.7)
    assert zipfile.ZipFile(weights).infolist()  # still a readable zip: only the content hash can tell
    assert damage(run_dir / "step_00000006", "cheap") is None
    assert "mp_rank_00_model_states.pt is not the file that was saved" in damage(run_dir / "step_00000006", "full")
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8), capsys)
    assert status == 0, err[-3000:]
    warnings = _warnings(err)
    assert len(warnings) == 1 and "step_00000006 is damaged" in warnings[0] and "sha256" in warnings[0], err
    assert "resuming from the older step_00000004" in warnings[0] and "Traceback" not in err
    assert f"resumed from {run_dir}/step_00000004" in out
    # bit-exact: resume is the promise (same configuration, same machine, one code path)
    assert {s: train_losses(run_dir)[s] for s in (5, 6, 7, 8)} == {s: train_losses(straight)[s] for s in (5, 6, 7, 8)}


def _without_manifests(run_dir: Path) -> None:
    """Checkpoints as a megahash before manifests wrote them (or with the manifest deleted)."""
    for m in run_dir.glob("step_*/manifest.json"):
        m.unlink()


def test_no_manifest_and_a_truncated_weights_file_falls_back(straight, shakespeare_shards, tmp_path, capsys):
    """No manifests, step 6's DeepSpeed weights file truncated (what gave a 50-line traceback): one
    warning, resumed from step 4, steps 5-8 as the straight run's."""
    run_dir = _copy(straight, tmp_path / "run")
    _without_manifests(run_dir)
    weights = run_dir / "step_00000006" / "mp_rank_00_model_states.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8), capsys)
    assert status == 0 and "Traceback" not in err, err[-3000:]
    warnings = _warnings(err)
    assert "step_00000006 is damaged" in warnings[0] and "mp_rank_00_model_states.pt" in warnings[0], err
    assert "step_00000004 is only partly verified: it has no manifest.json" in warnings[1] and len(warnings) == 2
    assert f"resumed from {run_dir}/step_00000004" in out
    assert {s: train_losses(run_dir)[s] for s in (5, 6, 7, 8)} == {s: train_losses(straight)[s] for s in (5, 6, 7, 8)}


def _spoil_pickle(pt: Path) -> None:
    """Overwrite the first bytes of a torch file's pickle (its zip member ``*/data.pkl``) in place: the zip's
    directory and every size stay, unpickling fails."""
    with zipfile.ZipFile(pt) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    data = bytearray(pt.read_bytes())
    head = info.header_offset  # the local header: its name and extra field lengths (torch pads the extra field)
    start = (
        head
        + 30
        + int.from_bytes(data[head + 26 : head + 28], "little")
        + int.from_bytes(data[head + 28 : head + 30], "little")
    )
    assert data[start] == 0x80  # pickle's PROTO opcode
    data[start : start + 4] = b"\xfe\xfe\xfe\xfe"
    pt.write_bytes(bytes(data))


def test_a_checkpoint_that_fails_to_load_falls_back(straight, shakespeare_shards, tmp_path, capsys):
    """No manifests and ``train.verify_checkpoint=cheap``: step 6's weights file is a readable zip of the
    right size whose pickle does not load, so verification passes it and DeepSpeed's load fails inside the
    set-up. The run starts again from a fresh engine with step 4 (one warning naming the failure) and
    continues the straight run bit for bit."""
    run_dir = _copy(straight, tmp_path / "run")
    _without_manifests(run_dir)
    _spoil_pickle(run_dir / "step_00000006" / "mp_rank_00_model_states.pt")
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8, "train.verify_checkpoint=cheap"), capsys)
    assert status == 0 and "Traceback" not in err, err[-3000:]
    failed = [w for w in _warnings(err) if "step_00000006 is damaged" in w]
    assert len(failed) == 1 and "it failed to load: " in failed[0] and "older step_00000004" in failed[0], err
    assert f"resumed from {run_dir}/step_00000004" in out
    assert {s: train_losses(run_dir)[s] for s in (5, 6, 7, 8)} == {s: train_losses(straight)[s] for s in (5, 6, 7, 8)}


def test_nothing_intact_is_one_line_and_exit_2(straight, shakespeare_shards, tmp_path, capsys):
    """The only checkpoint's weights flipped: no fresh start, one ``error:`` line naming the file."""
    run_dir = _copy(straight, tmp_path / "run", keep=("step_00000002",))
    _flip(next((run_dir / "step_00000002" / "model").glob("*.distcp")))
    before = (run_dir / "metrics.jsonl").read_text()
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8), capsys)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: no intact checkpoint in") and "model/__0_" in lines[0] and "sha256" in lines[0]
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing of the run touched
    assert not (run_dir / "megahash.lock").exists()  # released on the error's way out too


class _Payload:
    """A pickle that runs ``touch MARKER`` when unpickled (torch.load(weights_only=False) would)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_forged_newest_checkpoint_stops_the_resume_instead_of_falling_back(
    straight, shakespeare_shards, tmp_path, capsys, monkeypatch
):
    """Integrity and trust together (docs/security.md): step 6's DeepSpeed weights file forged to run a
    command, its manifest rewritten as a forger would (so verification at ``full`` passes it), step 4
    intact. ``train.resume=auto`` does not fall back past it to step 4 as it would past damage: one
    ``error:`` line naming step 6, the call it asks for and both ways on (``train.trust_checkpoint=true``,
    ``train.resume=`` an older checkpoint), exit 2, nothing run, nothing of the run touched, no warning of
    damage. Resuming step 4 by its path then continues the straight run bit for bit and replaces the forged
    step 6 with its own save, whose pickle runs nothing."""
    import torch

    from megahash.checkpoint.manifest import damage, write_manifest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # this install's key: not the forger's
    run_dir = _copy(straight, tmp_path / "run")
    marker = tmp_path / "RAN"
    forged = run_dir / "step_00000006"
    weights = forged / "mp_rank_00_model_states.pt"
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state["extra"] = _Payload(marker)
    torch.save(state, weights)
    write_manifest(forged)
    assert damage(forged, "full") is None  # intact as far as integrity can tell
    before = _snapshot(run_dir)
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8), capsys)
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert status == 2 and len(lines) == 1 and not marker.exists(), err[-3000:]
    assert lines[0].startswith(f"error: checkpoint {forged} was not written by this install"), lines
    assert "posix.system" in lines[0] and "train.trust_checkpoint=true" in lines[0], lines
    assert "train.resume=" in lines[0] and not _warnings(err) and "Traceback" not in err
    assert _snapshot(run_dir) == before  # the lock it took is gone again, nothing else changed

    status, out, err = _main(_args(shakespeare_shards, run_dir, 8, f"train.resume={run_dir}/step_00000004"), capsys)
    assert status == 0 and not marker.exists(), err[-3000:]
    assert {s: train_losses(run_dir)[s] for s in (5, 6, 7, 8)} == {s: train_losses(straight)[s] for s in (5, 6, 7, 8)}
    from megahash.checkpoint import deepspeed_files

    assert not deepspeed_files.unsafe_globals(forged) and damage(forged, "full") is None


def test_a_forged_dist_checkpoint_is_skipped_like_damage(straight, shakespeare_shards, tmp_path, capsys):
    """A refusal no flag can lift: step 6's ``model/.metadata`` replaced by a pickle that calls
    ``os.system`` (manifest rewritten), read when the resume changes the layout (ZeRO 0 -> 1: the weights
    from ``model/``). Its load is refused with nothing run, and ``train.resume=auto`` treats that as damage:
    one warning naming the refusal, the resume from step 4 (docs/security.md)."""
    import pickle

    from megahash.checkpoint.manifest import write_manifest

    run_dir = _copy(straight, tmp_path / "run")
    marker = tmp_path / "RAN"
    forged = run_dir / "step_00000006"
    (forged / "model" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    write_manifest(forged)
    status, out, err = _main(_args(shakespeare_shards, run_dir, 8, "train.zero_stage=1"), capsys)
    assert status == 0 and not marker.exists() and "Traceback" not in err, err[-3000:]
    warnings = _warnings(err)
    assert len(warnings) == 1 and f"checkpoint {forged} is damaged (it failed to load: " in warnings[0], err
    assert "posix.system: refused" in warnings[0] and "older step_00000004" in warnings[0], warnings
    assert f"resumed from {run_dir}/step_00000004" in out


@pytest.mark.parametrize("command", ["export-hf", "export", "eval"])
def test_eval_and_export_refuse_a_damaged_checkpoint_in_one_line(straight, tmp_path, capsys, command):
    """A byte flipped in ``model/``: ``export-hf``, ``export`` and ``eval --text`` of that step refuse it in
    one line before loading anything, and write nothing."""
    from megahash.cli import main

    run_dir = _copy(straight, tmp_path / "run", keep=("step_00000008",))
    ckpt = run_dir / "step_00000008"
    _flip(next((ckpt / "model").glob("*.distcp")))
    out = tmp_path / "out"
    argv = {
        "export-hf": ["export-hf", "--checkpoint", str(ckpt), "--output", str(out)],
        "export": ["export", "--checkpoint", str(ckpt), "--output", str(out), "--quantize", "int8"],
        "eval": ["eval", "--checkpoint", str(ckpt), "--text", str(ROOT / "README.md"), "--out", str(out)],
    }[command]
    status = main(argv)
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {ckpt} is damaged (model/__0_") and "sha256" in err[0], err
    assert not out.exists()


# -- one run per save_dir ------------------------------------------------------------------------------


def _snapshot(run_dir: Path) -> dict:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def _in_its_own_group(args: list[str]) -> subprocess.Popen:
    """megahash/pretrain.py in a process group of its own (signals go to the group, as a launcher's)."""
    return subprocess.Popen(
        [sys.executable, "megahash/pretrain.py", *args],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_one_run_per_save_dir(shakespeare_shards, tmp_path, capsys):
    """A real run, stopped (SIGSTOP to its process group) after its first checkpoint, holds the lock: a
    second run on the same save_dir refuses in one line naming the first's pid and touches nothing of it;
    ``pretrain.py --check inputs`` runs beside it and leaves the lock; after SIGCONT, SIGTERM to the
    first run's process group makes it checkpoint and exit 3, and its lock is gone; then a run resumes."""
    from test_launch import continue_group, wait_for_step

    run_dir = tmp_path / "run"
    proc = _in_its_own_group(_args(shakespeare_shards, run_dir, 500))
    try:
        wait_for_step(run_dir, 3, lambda: proc.poll() is None)
        os.killpg(proc.pid, signal.SIGSTOP)
        lock = json.loads((run_dir / "megahash.lock").read_text())
        assert lock["pid"] == proc.pid and lock["host"] and lock["started"]
        before = _snapshot(run_dir)
        status, out, err = _main(_args(shakespeare_shards, run_dir, 8), capsys)
        lines = [l for l in err.strip().splitlines() if l.strip()]
        assert status == 2 and len(lines) == 1 and f"is in use by another run (pid {proc.pid} on " in lines[0], err
        assert _snapshot(run_dir) == before  # nothing of the first run touched
        from megahash.pretrain import main

        assert main(["--check", "inputs", *_args(shakespeare_shards, run_dir, 8)]) == 0
        capsys.readouterr()
        assert json.loads((run_dir / "megahash.lock").read_text())["pid"] == proc.pid
        continue_group(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        _out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 3, err[-3000:]  # checkpointed and stopped for requeue
    assert not (run_dir / "megahash.lock").exists()
    stopped = max(train_losses(run_dir))
    status, out, err = _main(_args(shakespeare_shards, run_dir, stopped + 1), capsys)
    assert status == 0 and f"resumed from {run_dir}/step_{stopped:08d}" in out, err[-3000:]
    assert not (run_dir / "megahash.lock").exists()


def _forged(path: Path, **fields) -> None:
    from megahash.training.run_lock import holder_of_this_process

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**holder_of_this_process(), **fields}))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_locks_are_reclaimed_live_ones_refused(tmp_path, capsys, monkeypatch):
    """Reclaimed with one line: a holder on this host whose process is gone, or whose pid now belongs to
    another process (start time differs), an earlier run of this requeued SLURM job on another node, a
    lock file that never got its holder (30 s old). Refused, naming the holder: a live process on this
    host, another host's run, another SLURM job, a concurrent step of this job."""
    from megahash.errors import ConfigError
    from megahash.training import run_lock

    lock = tmp_path / "run" / run_lock.LOCK
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    reclaimed = {
        "dead pid": dict(pid=_dead_pid()),
        "recycled pid": dict(start_ticks=run_lock.start_ticks(os.getpid()) - 1),
        "requeued job": dict(host="node-a", boot_id="x", slurm_job_id="77", slurm_restart_count=0),
    }
    for case, fields in reclaimed.items():
        _forged(lock, **fields)
        path = run_lock.acquire(lock.parent)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"megahash: reclaimed the stale lock of {lock.parent}"), case
        assert (
            json.loads(lock.read_text())["pid"] == os.getpid() and json.loads(lock.read_text())["slurm_job_id"] == "77"
        )
        run_lock.release(path)
        assert not lock.exists(), case
    lock.write_text("")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    run_lock.release(run_lock.acquire(lock.parent))
    assert "holder was never written" in capsys.readouterr().err
    refused = {
        "live process": dict(started="2026-01-01T00:00:00"),
        "another host": dict(host="node-b", boot_id="y", slurm_job_id=""),
        "another job": dict(host="node-b", boot_id="y", slurm_job_id="78", slurm_restart_count=0),
        "same job, same restart": dict(host="node-b", boot_id="y", slurm_job_id="77", slurm_restart_count=1),
    }
    for case, fields in refused.items():
        _forged(lock, **fields)
        with pytest.raises(ConfigError) as e:
            run_lock.acquire(lock.parent)
        host = fields.get("host", run_lock.holder_of_this_process()["host"])
        assert f"is in use by another run (pid {os.getpid()} on {host}" in str(e.value), case
        assert "\n" not in str(e.value) and lock.exists(), case
    lock.unlink()


# -- one history after a resume ------------------------------------------------------------------------


def test_one_history_after_a_killed_run(shakespeare_shards, tmp_path, capsys):
    """A run killed (SIGKILL to its process group) some steps after its newest checkpoint k: the resumed
    run (in this process) reclaims the dead run's lock in one line, and metrics.jsonl then holds one train
    record per step, in order, the records past k of the killed run dropped; the resumed run's TensorBoard
    file starts with the purge marker at step k + 1 and TensorBoard's EventAccumulator reads the resumed
    run's losses past k, once each."""
    from test_launch import wait_for_step

    run_dir = tmp_path / "run"
    every = ("train.save_interval=3", "logging.tensorboard=true")
    args = _args(shakespeare_shards, run_dir, 500, *every)
    proc = _in_its_own_group(args)
    try:
        wait_for_step(run_dir, 4, lambda: proc.poll() is None, timeout=600, group=proc.pid)
        while True:  # stopped where records past the newest checkpoint exist
            # the run's process alone: a SIGSTOP to its group while it forks a helper left that helper
            # stopped after the group's SIGCONT (state T), the run waiting on it forever (1 run in 5, -n 2)
            os.kill(proc.pid, signal.SIGSTOP)
            last = max(train_losses(run_dir))
            if last % 3:
                break
            os.kill(proc.pid, signal.SIGCONT)
            wait_for_step(run_dir, last + 1, lambda: proc.poll() is None, timeout=300, group=proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    k = last - last % 3
    assert (run_dir / "megahash.lock").exists() and (run_dir / f"step_{k:08d}").is_dir()
    steps = k + 4
    status, out, err = _main(_args(shakespeare_shards, run_dir, steps, *every), capsys)
    assert status == 0, err[-3000:]
    assert f"resumed from {run_dir}/step_{k:08d}" in out
    assert f"megahash: reclaimed the stale lock of {run_dir} (pid {proc.pid} on" in err
    recs = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["step"] for r in recs if r["split"] == "train"]
    assert train == list(range(1, steps + 1)), train
    saved = [r["saved_step"] for r in recs if r["split"] == "checkpoint"]
    assert saved == sorted(set(saved)) == list(range(3, steps + 1, 3)) + ([steps] if steps % 3 else [])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    restarts = [  # each run's writer starts with TensorBoard's purge marker: 1 (from scratch), then k + 1
        ev.step
        for f in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        for ev in EventFileLoader(str(f)).Load()
        if ev.HasField("session_log") and ev.session_log.status == ev.session_log.START
    ]
    assert sorted(restarts) == [1, k + 1], restarts
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    events = [e for e in acc.Scalars("train/loss") if e.step > k]  # (the killed run's buffered events may be lost)
    files = [
        (f.name, [(ev.step, ev.wall_time) for ev in EventFileLoader(str(f)).Load() if ev.HasField("session_log")])
        for f in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    ]
    assert [e.step for e in events] == list(range(k + 1, steps + 1)), files
    losses = {r["step"]: r["loss"] for r in recs if r["split"] == "train"}
    assert [e.value for e in events] == pytest.approx([losses[e.step] for e in events], rel=1e-6)


def test_a_resumed_runs_event_file_sorts_after_its_killed_predecessors(tmp_path):
    """TensorBoard reads a folder's event files in name order, a name starting with the second its writer was
    made: a killed run's file made in this second by a process with a larger pid (as it was in CI, a tiny run
    killed and resumed within one second) sorted after the resumed run's, so its purge marker hid the resumed
    steps. A new writer now waits for the next second: its file sorts last, and its events are the ones
    TensorBoard keeps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from megahash.training.logging import wait_for_a_later_second

    folder = tmp_path / "tensorboard"
    killed = SummaryWriter(str(folder), purge_step=1)
    killed.add_scalar("train/loss", 5.0, 4)
    killed.close()
    (old,) = folder.glob("events.out.tfevents.*")
    stamp = int(old.name.split(".")[3])
    old.rename(folder / f"events.out.tfevents.{stamp}.zzzz.99999999.0")  # sorts after any name of this second
    wait_for_a_later_second(folder)
    resumed = SummaryWriter(str(folder), purge_step=4)
    for step in (4, 5, 6):
        resumed.add_scalar("train/loss", float(step), step)
    resumed.close()
    names = sorted(f.name for f in folder.glob("events.out.tfevents.*"))
    assert names[0].endswith(".zzzz.99999999.0") and int(names[1].split(".")[3]) > stamp, names
    acc = EventAccumulator(str(folder))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(4, 4.0), (5, 5.0), (6, 6.0)]


def test_waiting_for_a_later_second_is_bounded(tmp_path):
    """An event file stamped in the future (another node's clock on a shared folder) costs at most the bound."""
    from megahash.training.logging import wait_for_a_later_second

    (tmp_path / f"events.out.tfevents.{int(time.time()) + 3600}.host.1.0").write_bytes(b"")
    t0 = time.monotonic()
    wait_for_a_later_second(tmp_path, most=0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    wait_for_a_later_second(tmp_path / "missing")  # no folder yet: nothing to wait for


def test_keep_history_drops_what_was_logged_past_the_start(tmp_path):
    """The records past the start step go (an asynchronous save's record by the step it saved, a line cut
    short by a kill too); the file is rewritten only when something goes; the last dropped step is what
    W&B already holds; TensorBoard's purge_step is the first x value after the start on every x-axis."""
    from megahash.config import load_config
    from megahash.training.logging import keep_history, purge_step

    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 7)]
    recs.insert(4, {"step": 5, "split": "checkpoint", "saved_step": 4})  # published at step 5
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 7, "spl')
    assert keep_history(path, 4) == 6
    kept = [json.loads(l) for l in path.read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in kept] == [
        (1, "train"),
        (2, "train"),
        (3, "train"),
        (4, "train"),
        (5, "checkpoint"),
    ]
    before = path.stat().st_mtime_ns
    assert keep_history(path, 4) == 0 and path.stat().st_mtime_ns == before
    assert keep_history(tmp_path / "none.jsonl", 3) == 0
    cfg = load_config(None, ["train.global_batch_size=8", "data.seq_length=16"])
    assert purge_step(cfg, 4) == 5
    assert purge_step(load_config(None, ["logging.x_axis=samples", "train.global_batch_size=8"]), 4) == 33
    tokens = load_config(None, ["logging.x_axis=tokens", "train.global_batch_size=8", "data.seq_length=16"])
    assert purge_step(tokens, 4) == 4 * 8 * 16 + 1


def test_damaged_lines_of_the_history_are_passed_over(tmp_path):
    """metrics.jsonl lines that are not records: nested past the recursion limit in the tail keep_history reads
    (a RecursionError traceback at the start of a resume), a record whose step is a list after an asynchronous
    save's (a TypeError there), and a line cut short before the step a run resumes at, which keep_history does not
    read (the loss plot at the end of the finished run raised JSONDecodeError, exit 1; the grid report dropped
    every curve of the run): the resume drops the tail's, the plot and the grid report pass over the rest."""
    from megahash.experiments.grid_report import _metrics
    from megahash.training.logging import keep_history, plot_loss, read_metrics

    path = tmp_path / "metrics.jsonl"
    recs = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 5)]
    lines = [json.dumps(r) for r in recs]
    lines.insert(1, '{"step": 1, "split": "train", "loss": [1')  # before the resume's step: never rewritten
    lines += ["[" * 100000, json.dumps({"saved_step": 9, "step": [1]}), json.dumps({"step": 5, "loss": "x"})]
    path.write_text("\n".join(lines) + "\n")
    assert keep_history(path, 4) == 5  # the three tail lines go (step 5 the last record past the start)
    assert path.read_text().count("\n") == 5 and "[[[" not in path.read_text()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert plot_loss(tmp_path).stat().st_size > 0
    assert len(_metrics(tmp_path)) == 4


def test_ranks_share_the_hashing_of_a_verification():
    """digest.share: every file hashed by exactly one rank, the same split on every rank, the largest
    files spread first (LPT: no rank more than the largest file above the mean)."""
    from megahash.checkpoint.digest import share

    sizes = {f"f{i}": s for i, s in enumerate([900, 10, 500, 500, 300, 7, 7, 200, 100, 1])}
    for world in (1, 2, 3, 8):
        parts = [share(sizes, r, world) for r in range(world)]
        assert sorted(f for p in parts for f in p) == sorted(sizes)
        loads = [sum(sizes[f] for f in p) for p in parts]
        assert max(loads) <= sum(sizes.values()) / world + max(sizes.values())
        assert parts == [share(dict(reversed(sizes.items())), r, world) for r in range(world)]


WANDB_RESUME = r"""
import sys, time
from megahash.config import load_config
from megahash.training.logging import RunLogger
cfg = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline", "logging.tensorboard=false",
                         f"train.save_dir={sys.argv[1]}"])
log = RunLogger(cfg, 0)  # the run that is killed after step 4 (its checkpoint: step 2)
for step in range(1, 5):
    log.log(step, {"loss": 1.0 / step}, echo=False)
log.close()
time.sleep(1.1)  # wandb names a run's folder by the second it started: a real requeue is never within it
log = RunLogger(cfg, 0, start=2)  # resumed from step 2
for step in range(3, 7):
    log.log(step, {"loss": 1.0 / step}, echo=False)
log.close()
"""


def _wandb_history_steps(path: Path) -> list[int]:
    """The steps of the history records of an offline W&B run file (W&B's LevelDB-log framing: a 7-byte
    header, then records of CRC-32, length, type in 32 KiB blocks; each record a ``Record`` protobuf)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, steps, part = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # first, middle part of a record
            part += chunk
            continue
        if kind not in (1, 4):  # full, last part
            break
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(part + chunk)
        part = b""
        if rec.WhichOneof("record_type") == "history":
            steps.append(rec.history.step.num)
    return steps


def test_wandb_gets_the_steps_after_the_kill_once(tmp_path):
    """The same W&B run continues after a resume from step 2 of a run killed after step 4: the resumed
    run sends steps 5 and 6 only (steps 3 and 4 are in W&B already; its history only grows), while
    metrics.jsonl holds steps 1-6 once each. (Real wandb, offline; its run files read back.)"""
    from conftest import run

    r = run([sys.executable, "-c", WANDB_RESUME, str(tmp_path)], WANDB_MODE="offline")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [_wandb_history_steps(p) for p in runs] == [[1, 2, 3, 4], [5, 6]]
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_loss_plot_that_fails_half_way_leaves_the_previous_one(tmp_path, monkeypatch):
    """The run's loss_curve.png is written under a temp name and renamed: a save that fails half way (a full disk,
    the job killed while plotting) leaves the previous PNG whole and no temp file (it was written in place)."""
    import errno
    import io

    import matplotlib.figure

    from megahash.training.logging import plot_loss

    recs = [{"step": s, "split": "train", "loss": 1.0 / s} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    png = plot_loss(tmp_path)
    before = png.read_bytes()
    real = matplotlib.figure.Figure.savefig

    def half(self, fname, *a, **k):
        buf = io.BytesIO()
        real(self, buf, *a, **{**k, "format": "png"})
        open(fname, "wb").write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", half)
    with pytest.raises(OSError, match="No space left"):
        plot_loss(tmp_path)
    assert png.read_bytes() == before and before[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss_curve.png", "metrics.jsonl"]
