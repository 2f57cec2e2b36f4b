"""A full disk at start (issue 47.5, megahash/data/index_cache.py): megatron-core's dataset index cache cannot
be written under ``data.cache_dir``. Through the real entry point, one line naming the directory and the fix,
exit 2, and no half-written index left behind (megatron would take a cache whose four files exist as
complete). Before: a 60-line traceback ending in megatron's "Failed to write dataset materials".

The filesystem: a real 128 KiB tmpfs mounted in a user and mount namespace of the run's own (``unshare -rm``,
no root needed where the kernel allows unprivileged user namespaces, as on the 2-core test machine); it holds
the description, the document index and the sample index of the run's train split (~96 KiB) but not the
shuffle index, so the build fails half-way (ENOSPC, or numpy's short write). Only where namespaces are not
allowed, the one-rank case runs instead with ``RLIMIT_FSIZE`` of 64 KiB (SIGXFSZ ignored), where the sample
index write fails with EFBIG: the same code path (an OSError while megatron writes), not a full disk."""

import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from test_step_guard import TINY  # the tiny decoder, fp32, no evaluation, plots or TensorBoard

from conftest import ROOT, child_env

LEFT = "cache files left:"


def _namespaces_allowed(tmp_path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = f"mount -t tmpfs -o size=4k tmpfs {tmp_path}"
    return subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True).returncode == 0


def _fsize_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=[pytest.mark.slow, pytest.mark.multiprocess])])
def test_a_full_disk_at_start_is_one_line_and_leaves_no_half_written_cache(shakespeare_shards, tmp_path, ranks):
    """2 ranks: the same under DeepSpeed's launcher: rank 0 prints the line; rank 1, waiting in megatron's
    barrier for rank 0's build, stops silently (exit 2 when its barrier breaks first, else the launcher ends
    it): no traceback of the broken barrier (there was one before rank 1's path in index_cache.writing)."""
    from megahash.launching.env import free_port

    mount, cache = tmp_path / "small", tmp_path / "small" / "cache"
    mount.mkdir()
    two, tmpfs = ranks == 2, _namespaces_allowed(mount)
    if two and not tmpfs:
        pytest.skip("no unprivileged user and mount namespaces here (the one-rank case runs under RLIMIT_FSIZE)")
    launcher = ["deepspeed", "--log_level", "error", "--num_gpus", "2", "--master_port", str(free_port())]
    pretrain = [
        *(launcher if two else [sys.executable]),
        "megahash/pretrain.py",
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINY,
        "train.steps=2",
        f"data.cache_dir={cache}",
        f"train.save_dir={tmp_path / 'run'}",
    ]
    if tmpfs:
        script = f'mount -t tmpfs -o size=128k tmpfs {mount} && "$@"; s=$?; echo "{LEFT} $(ls -A {cache} 2>/dev/null)"; exit $s'
        cmd, preexec = ["unshare", "-rm", "sh", "-c", script, "sh", *pretrain], None
    else:
        cmd, preexec = pretrain, _fsize_limit
    r = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600, preexec_fn=preexec)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error: ") or not two]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    assert lines[0].startswith("error: cannot write the dataset index cache: ") and str(cache) in lines[0], lines
    assert "set data.cache_dir to a writable directory" in lines[0]
    reason = "No space left on device" if tmpfs else "File too large"
    left = r.stdout.splitlines()[-1] if tmpfs else f"{LEFT} {' '.join(os.listdir(cache))}"
    assert reason in lines[0] or "requested and" in lines[0], lines  # numpy's short write has no errno
    assert left == f"{LEFT} ", left  # the failed build's files are gone
