"""Skipped steps (issue 35, megahash/training/step_guard.py): a NaN gradient on ONE of two ranks skips
the update on both, parameters keep their bit pattern across it, training goes on with finite losses,
the skips are logged, and ``train.step_guard.max_skips`` consecutive skips stop the run in one line (exit 2).
Also the spike rule against its formula.

The NaN is injected by tests/training/nonfinite_worker.py: a tensor hook on one weight, registered by the test's
wrapper around the trainer's model builder, NaNs one gradient element on rank 1 at chosen steps. The
library has no test-only code path for it; a poisoned data sample cannot do it (samples are token ids,
integers: a bad one is a valid token or an index error, never a NaN), and the forward pass and the loss
stay finite, so only the gradient rule can catch it."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

import conftest
from conftest import popen

TINY = [*conftest.TINY, "train.eval_interval=0", "train.save_interval=0", "train.precision=fp32"]


def test_spike_rule_is_k_times_the_running_median():
    """L_s is a spike iff the window of the last W applied losses is full and L_s > k * median(window);
    skipped (spike) losses do not enter the window; non-finite losses are no spikes."""
    from megahash.training.step_guard import SpikeRule

    k, w = 2.0, 4
    rule = SpikeRule(k, w)
    losses = [5.0, 4.0, 6.0, 3.0, 9.5, 10.5, 3.5, 100.0, float("nan"), float("inf"), 7.1]
    window, flagged = [], []
    for loss in losses:
        # the formula, written out: median of the last W accepted losses (even W: mean of the middle two)
        full = len(window) == w
        ref = full and math.isfinite(loss) and loss > k * statistics.median(window[-w:])
        spike = rule.is_spike(loss)
        assert spike == ref, (loss, window)
        flagged.append(spike)
        if not spike and math.isfinite(loss):
            rule.record(loss)
            window = (window + [loss])[-w:]
    # window [5,4,6,3] -> median 4.5: 9.5 > 9 is a spike; 10.5 too; then 3.5 enters ([4,6,3,3.5], median 3.75)
    assert flagged == [False, False, False, False, True, True, False, True, False, False, False]
    assert list(rule.window) == [6.0, 3.0, 3.5, 7.1]
    assert not SpikeRule(0.0, 4).is_spike(1e30)  # factor 0: off


def _launch(tmp_path, poison_at: str, overrides: list[str]):
    """Two gloo ranks of tests/training/nonfinite_worker.py (the pretrain entry point; NaN gradient on rank 1)."""
    from megahash.launching.env import free_port

    worker = os.path.join(os.path.dirname(__file__), "nonfinite_worker.py")
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, worker, str(tmp_path), "1", poison_at, *overrides]
        procs.append(popen(cmd, subprocess.PIPE, subprocess.PIPE, **env))
    outs = [p.communicate(timeout=600) for p in procs]
    return [p.returncode for p in procs], outs


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dp2_zero1", "tp2"])
def test_nan_gradient_on_one_rank_skips_the_step_on_both(shakespeare_shards, tmp_path, layout):
    """2 ranks, NaN in one gradient element of rank 1 at steps 2, 4 and 5, train.step_guard.max_skips=2: step 2 is
    skipped on both ranks (parameters bit-identical to after step 1, the LR schedule held), step 3
    trains, steps 4-5 are two consecutive skips: one error line naming step 5 and its global samples
    32-39, exit 2 on both ranks. ``dp2_zero1`` (2 data-parallel ranks, ZeRO-1): the NaN reaches both
    ranks' reduced gradients and DeepSpeed's optimizer finds the non-finite global norm before it steps;
    the guard counts the skip. ``tp2`` (tensor parallel, the engine steps torch's AdamW): only rank 1's
    weight shard holds the NaN, rank 0's gradients are finite, and only the guard's all-reduced flag
    makes rank 0 skip too."""
    import torch

    save_dir = tmp_path / "run"
    # backward passes to poison: one micro-batch a step at dp 2, two at tp 2 (the last of each step)
    passes, extra = {"dp2_zero1": ("2,4,5", ["train.zero_stage=1"]), "tp2": ("4,8,10", ["parallel.tensor=2"])}[layout]
    codes, outs = _launch(
        tmp_path,
        passes,
        [
            f"data.prefix=[{shakespeare_shards['prefix']}]",
            f"data.tokenizer={shakespeare_shards['tokenizer']}",
            *TINY,
            "train.steps=6",
            f"train.save_dir={save_dir}",
            *extra,
            "train.step_guard.skip_nonfinite=true",
            "train.step_guard.max_skips=2",
        ],
    )
    log = "\n".join(o + e for o, e in outs)
    assert codes == [2, 2], log[-4000:]
    errors = [line for line in outs[0][1].splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and "step 5" in errors[0] and "global samples 32-39" in errors[0], log[-4000:]
    assert "Traceback" not in log and not any(line.startswith("error: ") for line in outs[1][1].splitlines())
    assert "step 2 skipped (non-finite gradient norm)" in outs[0][0], outs[0][0][-3000:]

    recs = {
        r["step"]: r
        for r in map(json.loads, (save_dir / "metrics.jsonl").read_text().splitlines())
        if r["split"] == "train"
    }
    assert sorted(recs) == [1, 2, 3, 4, 5]
    assert [recs[s]["skipped"] for s in range(1, 6)] == [0, 1, 0, 1, 1]
    assert [recs[s]["skipped_steps"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    assert all(math.isfinite(recs[s]["loss"]) for s in recs)  # the NaN is in a gradient, never in the loss
    # Megatron's rule: a skipped step does not advance the LR schedule (warmup 2: step 1 at lr/2, step 2 at lr)
    assert recs[1]["lr"] < recs[2]["lr"] == recs[3]["lr"] and recs[4]["lr"] == recs[5]["lr"]

    params = {(r, s): torch.load(tmp_path / f"params_rank{r}_step{s}.pt") for r in (0, 1) for s in range(1, 6)}
    for r in (0, 1):
        # bit-exact: a skipped step applies nothing, so every parameter keeps its bit pattern (the promise)
        for s in (2, 5):
            prev = params[(r, s - 1)]
            assert all(torch.equal(params[(r, s)][n], prev[n]) for n in prev), (r, s)  # bit-exact: nothing applied
        # bit-exact: any changed bit shows that step 3 applied its update
        assert any(not torch.equal(params[(r, 3)][n], params[(r, 2)][n]) for n in params[(r, 2)])  # step 3 trains
        assert all(torch.isfinite(p).all() for s in range(1, 6) for p in params[(r, s)].values())
    if layout == "dp2_zero1":  # the data-parallel replicas stay identical (same reduced gradients, same decision)
        # bit-exact: replicas of one data-parallel group take the same update (rank-count independence)
        assert all(torch.equal(params[(0, s)][n], params[(1, s)][n]) for s in range(1, 6) for n in params[(0, s)])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dp2_zero2", "tp2"])
def test_nan_gradient_on_one_rank_stops_both_ranks_before_the_update(shakespeare_shards, tmp_path, layout):
    """``train.step_guard.skip_nonfinite`` off (the default), 2 ranks, NaN in one gradient element of rank 1 in step 3:
    both ranks refuse the update and stop, one error line (rank 0), exit 2 on both, each rank's parameters
    bit-identical to after step 2, whose checkpoint is the newest. ``dp2_zero2``: DeepSpeed's ZeRO-2
    optimizer finds the non-finite global norm; ``tp2``: only rank 1's shard holds the NaN, and the
    all-reduced decision stops rank 0 too (without it rank 0 would train on alone and hang)."""
    import torch

    save_dir = tmp_path / "run"
    passes, extra = {"dp2_zero2": ("3", ["train.zero_stage=2"]), "tp2": ("6", ["parallel.tensor=2"])}[layout]
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    overrides = [*data, *TINY, "train.steps=6", "train.save_interval=2", f"train.save_dir={save_dir}", *extra]
    codes, outs = _launch(tmp_path, passes, overrides)
    log = "\n".join(o + e for o, e in outs)
    assert codes == [2, 2], log[-4000:]
    errors = [line for line in outs[0][1].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: step 3: non-finite gradient norm"), log[-4000:]
    assert "Traceback" not in log and not any(line.startswith("error: ") for line in outs[1][1].splitlines())
    assert (save_dir / "latest").read_text().strip() == "step_00000002"
    for r in (0, 1):
        before = torch.load(tmp_path / f"params_rank{r}_step2.pt")
        after = torch.load(tmp_path / f"params_rank{r}_refused.pt")
        # bit-exact: a refused step applies nothing, so every parameter keeps its bit pattern (the promise)
        assert all(torch.equal(after[n], before[n]) for n in before), r
    assert not (tmp_path / "params_rank0_step3.pt").exists()


def test_a_diverging_lr_stops_in_one_line_with_the_newest_checkpoint_published(shakespeare_shards, tmp_path):
    """The issue's case through the real entry point: ``train.lr=1e6`` (no NaN planted) with asynchronous saves
    every 2 steps. The step whose gradient norm overflows is refused and the run stops in one line, exit 2;
    the newest checkpoint is the last one due before it, published complete (a save still in flight is
    finished first, not abandoned), and nothing half-written is left."""
    import re

    from conftest import pretrain_here

    save_dir = tmp_path / "run"
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    r = pretrain_here(
        [*data, *TINY, "train.lr=1e6", "train.warmup_steps=0", "train.steps=8", "train.save_interval=2",
         "train.async_save=true", f"train.save_dir={save_dir}"]
    )  # fmt: skip
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    step = int(re.match(r"error: step (\d+): non-finite (loss|gradient norm) ", errors[0]).group(1))
    newest = f"step_{(step - 1) // 2 * 2:08d}"
    assert step > 2 and newest in errors[0], errors
    assert (save_dir / "latest").read_text().strip() == newest
    assert (save_dir / newest / "megahash_state.json").is_file()
    assert not list(save_dir.glob("*.tmp*")), sorted(p.name for p in save_dir.iterdir())


def test_spike_skips_resume_exactly(shakespeare_shards, tmp_path, capsys):
    """One rank, in-process, spike rule k=1.0001 over a window of 1 (any rise of the loss is a spike): the
    run stopped just before its first skipped step and resumed skips it too (the window travels in the
    checkpoint) and reproduces the uninterrupted run bit for bit: losses, skips, LR held by each skip."""
    from megahash.pretrain import main

    def run(save_dir, *extra):
        status = main(
            [
                f"data.prefix=[{shakespeare_shards['prefix']}]",
                f"data.tokenizer={shakespeare_shards['tokenizer']}",
                *TINY,
                "train.steps=15",
                f"train.save_dir={save_dir}",
                "train.step_guard.spike_factor=1.0001",
                "train.step_guard.spike_window=1",
                "train.step_guard.max_skips=0",
                *extra,
            ]
        )
        assert status == 0, capsys.readouterr().err[-3000:]
        recs = {}
        for line in (save_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["split"] == "train":
                recs[r["step"]] = (r["loss"], r["skipped"], r["skipped_steps"], r["lr"])
        return recs

    straight = run(tmp_path / "straight")
    skipped = [s for s, r in sorted(straight.items()) if r[1]]
    assert skipped and skipped[0] > 2, straight  # the real loss rises at least once after the window fills
    for s in skipped:  # each skip holds the LR schedule: the next step uses the skipped step's LR
        assert straight[s][0] > 1.0001 * straight[s - 1][0] or straight[s - 1][1]
        if s + 1 in straight:
            assert straight[s + 1][3] == straight[s][3]
    split = tmp_path / "split"
    run(split, f"train.stop_after={skipped[0] - 1}")
    assert run(split) == straight


def _poison(monkeypatch, at_pass: int, snapshots: list):
    """Test code around the trainer (as tests/training/nonfinite_worker.py): a NaN into one gradient element
    of the first MLP weight at backward pass ``at_pass`` (1-based; 0: none), and this rank's parameters
    appended to ``snapshots`` as (steps done, parameters) before and after every step the trainer runs, the
    one that stops the run included."""
    from megahash.training import trainer

    build_model, step_logged, passes = trainer._build_model, trainer._train_step_logged, [0]

    def poisoned_build_model(cfg, data):
        model, n_params, n_emb = build_model(cfg, data)

        def hook(grad):
            passes[0] += 1
            if passes[0] != at_pass:
                return grad
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
            return grad

        model.decoder.layers[0].mlp.linear_fc1.weight.register_hook(hook)
        return model, n_params, n_emb

    def params(run):
        return run.step, {n: p.detach().clone() for n, p in run.engine.module.named_parameters()}

    def step_and_snapshot(run):
        snapshots.append(params(run))
        try:
            step_logged(run)
        finally:
            snapshots.append(params(run))

    monkeypatch.setattr(trainer, "_build_model", poisoned_build_model)
    monkeypatch.setattr(trainer, "_train_step_logged", step_and_snapshot)


NONFINITE_VARIANTS = {  # one rank, in process: (overrides, backward passes a step, pass of step 3 poisoned)
    "fp32_accumulation": (["train.micro_batch_size=2"], 4, 3),  # ZeRO-0, 4 micro-batches a step: the 3rd
    "muon": (["train.optimizer=muon", "train.muon.lr=0.02"], 2, 2),
    "bf16": (["train.precision=bf16"], 2, 2),  # autocast over fp32 parameters
}


@pytest.mark.parametrize("variant", sorted(NONFINITE_VARIANTS))
def test_a_nonfinite_step_is_refused_before_its_update_and_stops_in_one_line(
    shakespeare_shards, tmp_path, capsys, monkeypatch, variant
):
    """``train.step_guard.skip_nonfinite`` off (the default): a NaN in one gradient element in step 3 stops the run in one
    line, exit 2, before the update: the parameters after the refused step are those it started from bit for
    bit, the newest checkpoint on disk is step 2's, and a resume from it starts from those same parameters.
    Before issue 47 the NaN update was applied and the run died with a FloatingPointError traceback."""
    import torch

    from megahash.pretrain import main

    extra, per_step, poisoned = NONFINITE_VARIANTS[variant]
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINY, *extra, "train.steps=6", "train.save_interval=2", f"train.save_dir={tmp_path / 'run'}"]
    snapshots: list = []
    _poison(monkeypatch, 2 * per_step + poisoned, snapshots)
    status = main(common)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("error: step 3: non-finite gradient norm") and "step_00000002" in errors[0], errors
    assert "train.step_guard.skip_nonfinite=true" in errors[0]
    assert [s for s, _ in snapshots] == [0, 1, 1, 2, 2, 2]  # the refused step never counted
    (_, before), (_, after) = snapshots[-2], snapshots[-1]
    # bit-exact: a refused step applies nothing, so every parameter keeps its bit pattern (the promise)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert (tmp_path / "run" / "latest").read_text().strip() == "step_00000002"

    monkeypatch.undo()  # the resume, without the NaN: it starts from the checkpoint's parameters
    resumed: list = []
    _poison(monkeypatch, 0, resumed)
    status = main([*common, "train.steps=3"])
    out, err = capsys.readouterr()
    assert status == 0 and f"resumed from {tmp_path / 'run' / 'step_00000002'}" in out, err[-3000:]
    (start, loaded) = resumed[0]
    # bit-exact: a resume restores the saved weights (the promise of a checkpoint)
    assert start == 2 and all(torch.equal(loaded[n], before[n]) for n in before)
