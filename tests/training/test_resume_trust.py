"""Resume reads DeepSpeed's files without running code (issue 47 item 1; megahash/checkpoint/deepspeed_files.py,
origin.py). DeepSpeed would ``torch.load(weights_only=False)`` its model states and ZeRO partitions: megahash
loads them weights-only with torch's safe globals for the classes DeepSpeed pickles, so a file that asks
for anything else (a forged os.system call) is refused in one line before anything is unpickled, unless
``train.trust_checkpoint=true`` (which then does what it says: the pickle runs); a checkpoint this install
signed (an HMAC under a key outside the checkpoint) resumes without the flag even when its files need
more than weights-only loading, a copy under another install's key, a changed pickle or a missing
signature does not. One rank, in this process, through the pretraining entry point."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch
from test_batch_ramp import _main

from conftest import TINIER
from megahash.checkpoint import deepspeed_files


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _args(shards, save_dir, steps, *extra):
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINIER,
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        f"train.steps={steps}",
        f"train.save_dir={save_dir}",
        *extra,
    ]


def _forge(ckpt, name, extra: dict) -> None:
    """Add ``extra`` to DeepSpeed's file ``name`` and rewrite the manifest (as a forger would)."""
    f = ckpt / name
    state = torch.load(f, map_location="cpu", weights_only=False)  # our own file
    state.update(extra)
    torch.save(state, f)
    from megahash.checkpoint.manifest import write_manifest

    write_manifest(ckpt)  # sizes and sha256 again: a forger who can write the folder rewrites it too


def _error(out: str) -> list[str]:
    return [l for l in out.strip().splitlines() if l.startswith("error:")]


@pytest.mark.parametrize(
    "stage, name", [(0, "mp_rank_00_model_states.pt"), (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt")]
)
def test_a_forged_deepspeed_file_is_refused_unless_trusted(
    shakespeare_shards, tmp_path, capsys, monkeypatch, stage, name
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run, marker = tmp_path / "run", tmp_path / "RAN"
    zero = f"train.zero_stage={stage}"
    status, out = _main(_args(shakespeare_shards, run, 2, zero), capsys)
    assert status == 0, out[-3000:]
    _forge(run / "step_00000002", name, {"extra": Payload(marker)})
    status, out = _main(_args(shakespeare_shards, run, 3, zero), capsys)
    err = _error(out)
    assert status == 2 and len(err) == 1 and not marker.exists(), out[-3000:]
    assert "posix.system" in err[0] and "train.trust_checkpoint=true" in err[0] and "Traceback" not in out
    assert not (run / "step_00000003").exists()
    status, out = _main(_args(shakespeare_shards, run, 3, zero, "train.trust_checkpoint=true"), capsys)
    assert status == 0 and "with pickle (train.trust_checkpoint=true)" in out, out[-3000:]
    assert marker.exists()  # trusted: DeepSpeed's own torch.load ran the pickle, as the flag says


def test_a_checkpoint_this_install_signed_resumes_without_the_flag(shakespeare_shards, tmp_path, capsys, monkeypatch):
    """As after an upgrade whose DeepSpeed pickles a class megahash does not list (here: the list emptied,
    so ZeRO-3's loss scaler and stage enum need more than weights-only loading)."""
    monkeypatch.setattr(deepspeed_files, "DEEPSPEED_GLOBALS", ())
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(mine))
    run = tmp_path / "run"
    zero = "train.zero_stage=3"
    status, out = _main(_args(shakespeare_shards, run, 2, zero, "train.keep_last=0"), capsys)
    assert status == 0, out[-3000:]
    key = mine / "megahash" / "checkpoint.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    ckpt = run / "step_00000002"
    assert deepspeed_files.unsafe_globals(ckpt)  # what the emptied list leaves to pickle
    copies = {}
    for what in ("other install", "changed pickle", "no signature"):
        copies[what] = tmp_path / what.replace(" ", "_")
        shutil.copytree(run, copies[what])
    status, out = _main(_args(shakespeare_shards, run, 3, zero), capsys)
    assert status == 0 and "with pickle (this install wrote it)" in out, out[-3000:]

    _forge(copies["changed pickle"] / ckpt.name, "zero_pp_rank_0_mp_rank_00_optim_states.pt", {"x": 1})
    (copies["no signature"] / ckpt.name / "manifest.sig").unlink()
    for what, d in copies.items():
        monkeypatch.setenv("XDG_CACHE_HOME", str(theirs if what == "other install" else mine))
        status, out = _main(_args(shakespeare_shards, d, 3, zero), capsys)
        err = _error(out)
        assert status == 2 and len(err) == 1 and "was not written by this install" in err[0], (what, out[-3000:])
        assert "train.trust_checkpoint=true" in err[0]
