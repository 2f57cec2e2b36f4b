"""DeepSpeed's JIT-built CPU op (accelerator.deepspeed_ops.prepare_deepspeed_extensions): a lock left by a build
that was killed does not make every later launch wait forever; a virtual environment keeps its own
build folder."""

import os
import sys
import time

from megahash.accelerator import deepspeed_ops


def test_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, live = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, live):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - deepspeed_ops.STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    assert deepspeed_ops.prepare_deepspeed_extensions() == tmp_path
    assert not stale.exists() and live.exists()  # a build in progress (a fresh lock) is waited for, as torch does
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and str(stale) in out[0] and "killed" in out[0]


def test_a_lock_released_while_it_is_looked_at_is_passed_over(tmp_path, monkeypatch):
    """torch's ``load`` takes the lock for every load (its ninja then finds nothing to build), so another process
    of the venv releases it between the folder listing and the age check: that lock is gone, not an error (a CI
    run's in-process test failed with FileNotFoundError here)."""
    from pathlib import Path

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()
    gone = tmp_path / "deepspeed_shm_comm" / "lock"  # listed, then released before its stat
    glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pat: [*glob(self, pat), *([gone] if pat == "*/lock" else [])])
    assert deepspeed_ops.prepare_deepspeed_extensions() == tmp_path


def test_a_virtual_environment_builds_into_its_own_folder(tmp_path, monkeypatch):
    """Two Pythons sharing ~/.cache/torch_extensions rebuilt the op in turn (their include paths differ)."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))  # what a virtual environment's Python says
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path / "base"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "unset below; restored after the test")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert deepspeed_ops.prepare_deepspeed_extensions() == tmp_path / "venv" / "torch_extensions"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "torch_extensions")  # the ranks' builds
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "named"))
    assert deepspeed_ops.prepare_deepspeed_extensions() == tmp_path / "named"  # a folder the user names wins


def test_the_environments_ninja_builds_the_op(tmp_path, monkeypatch):
    """Debian's ninja 1.11 first on PATH and the lock's 1.13 (pip package) share the build log, whose command
    hashes they compute differently: each switch rebuilt the op. The package's ninja goes first."""
    import shutil
    import stat

    import ninja

    other = tmp_path / "usr-bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert shutil.which("ninja") == str(other / "ninja")
    deepspeed_ops.prepare_deepspeed_extensions()
    assert os.path.samefile(shutil.which("ninja"), os.path.join(ninja.BIN_DIR, "ninja"))
    path = os.environ["PATH"]
    deepspeed_ops.prepare_deepspeed_extensions()  # once first, PATH is left as it is
    assert os.environ["PATH"] == path
