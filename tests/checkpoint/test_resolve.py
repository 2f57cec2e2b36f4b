"""Reading a run's newest checkpoint while its training still saves (megahash/checkpoint/resolve.py
``read_while_kept``): a checkpoint pruned by the run (``train.keep_last``) in the middle of an ``eval`` or
``export-hf`` read is read again from the run's newest one; a named ``step_N`` that goes is one line saying
so. The pruning is played by hand at the moment the weights are read (megahash's own ``load_chosen``)."""

from __future__ import annotations

import shutil

import pytest
from test_faults import TINY

from conftest import megahash_here, pretrain_here


@pytest.fixture(scope="module")
def finished(shakespeare_shards, tmp_path_factory):
    """A finished 2-step run of one rank (step_00000002)."""
    run_dir = tmp_path_factory.mktemp("kept") / "run"
    r = pretrain_here(
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            "train.steps=2",
            "train.eval_interval=0",
            "train.zero_stage=0",
            f"train.save_dir={run_dir}",
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir / "step_00000002"


def _running_training(monkeypatch, run_dir, publish: bool):
    """At the first weights read: the run publishes step_00000004 (``publish``) and prunes the checkpoint being
    read, as a run with train.keep_last=1 does at its next save. Returns the folders whose weights were read."""
    from megahash.checkpoint import weights

    real, reads = weights.load_chosen, []

    def load_chosen(model, ckpt, which="live"):
        reads.append(ckpt.name)
        if len(reads) == 1:
            if publish:
                shutil.copytree(ckpt, run_dir / "step_00000004")
            shutil.rmtree(ckpt)
        return real(model, ckpt, which)

    monkeypatch.setattr(weights, "load_chosen", load_chosen)
    return reads


def test_a_checkpoint_pruned_while_read_is_read_again_from_the_newest(finished, tmp_path, monkeypatch):
    from megahash.accelerator import process_groups
    from megahash.checkpoint.weights import load_for_inference

    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir / finished.name)
    reads = _running_training(monkeypatch, run_dir, publish=True)
    try:
        _, model, ckpt = load_for_inference(run_dir)
    finally:
        process_groups.teardown()
    # before: "checkpoint .../step_00000002 has no ...; it is incomplete" (or "damaged or edited"), exit 2
    assert reads == ["step_00000002", "step_00000004"] and ckpt == run_dir / "step_00000004"
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_named_checkpoint_pruned_while_read_is_one_line(finished, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir / finished.name)
    _running_training(monkeypatch, run_dir, publish=True)
    r = megahash_here(["export-hf", "--checkpoint", str(run_dir / finished.name), "--output", str(tmp_path / "hf")])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert lines[0] == (
        f"error: checkpoint {run_dir / finished.name} was removed while it was read (a run saving into {run_dir} "
        f"prunes older checkpoints: train.keep_last); name the run directory {run_dir} (its newest is now "
        f"step_00000004) or copy the checkpoint elsewhere first"
    )
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_a_damaged_checkpoint_of_a_still_run_directory_is_not_read_again(finished, tmp_path, monkeypatch):
    """Nothing moved in the run directory: the failure is the checkpoint's own, said as before, read once."""
    from megahash.checkpoint import resolve
    from megahash.checkpoint.manifest import write_manifest

    run_dir = tmp_path / "run"
    ckpt = shutil.copytree(finished, run_dir / finished.name)
    for f in (ckpt / "model").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(f.read_bytes()[:64])  # cut short, the manifest written again: only the load sees it
    write_manifest(ckpt)
    real, picked = resolve.resolve_for_inference, []
    monkeypatch.setattr(resolve, "resolve_for_inference", lambda p, o=None: picked.append(real(p, o)) or picked[-1])
    r = megahash_here(["export-hf", "--checkpoint", str(run_dir), "--output", str(tmp_path / "hf")])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    assert "its config is not the weights' (damaged or edited)" in r.stderr, r.stderr
    assert picked == [ckpt] and not (tmp_path / "hf").exists()
