"""``train.ema.decay`` (issue 37 item 3, megahash/training/ema.py): the average after k steps equals its
closed form over the recorded weights, validation reports it (``ema_loss``), a stop + resume from an
asynchronous checkpoint continues it bit-exactly, evaluation and export read it with ``--weights ema``,
and asking a checkpoint without one is a one-line error. One tiny run under ``train.precision=bf16``."""

import json
import math
import shutil

import pytest
import torch
from test_batch_ramp import _main

from conftest import TINIER, TINY, pretrain_group

DECAY, STEPS = 0.6, 4


def _params(ckpt, weights="live") -> dict:
    from megahash.accelerator import process_groups
    from megahash.checkpoint.weights import load_for_inference

    _, model, _ = load_for_inference(ckpt, weights=weights)
    out = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    process_groups.teardown()
    return out


def _initial(ckpt) -> dict:
    """w_0: the model the trainer builds from train.seed before the first step (trainer._build_model)."""
    from megahash.accelerator import process_groups, rng
    from megahash.checkpoint.layout import read_state
    from megahash.checkpoint.resolve import checkpoint_config
    from megahash.models.megatron_model import MegahashLM

    cfg = checkpoint_config(ckpt)
    process_groups.init_distributed(1)
    rng.seed_all(cfg.train.seed)
    model = MegahashLM(cfg, int(read_state(ckpt)["padded_vocab_size"]), torch.float32, True)
    out = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    process_groups.teardown()
    return out


def _check_closed_form(run_dir, steps: int) -> None:
    """ema_k = d^k w_0 + (1-d) sum_i d^(k-i) w_i over the checkpoints of every step, in fp64."""
    ckpts = [run_dir / f"step_{k:08d}" for k in range(1, steps + 1)]
    w = [_initial(ckpts[0])] + [_params(c) for c in ckpts]
    ema = _params(ckpts[-1], "ema")
    assert set(ema) == set(w[0])
    for name, got in ema.items():
        want = DECAY**steps * w[0][name] + sum(
            (1 - DECAY) * DECAY ** (steps - i) * w[i][name] for i in range(1, steps + 1)
        )
        # fp32 updates: 2 roundings a step (|rel| <= 2^-24 each) over the steps, on values of the weights' size
        tol = 4 * steps * 2.0**-24 * max(float(want.abs().max()), 1.0)
        assert float((got - want).abs().max()) <= tol, name
    moved = max(float((ema[n] - w[-1][n]).abs().max()) for n in ema)
    assert moved > 1e-4  # the average is not the live weights


@pytest.mark.slow
def test_ema_formula_validation_resume_eval_export(shakespeare_shards, tmp_path, capsys):
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [
        *data,
        *TINIER,
        "train.precision=bf16",
        f"train.ema.decay={DECAY}",
        f"train.steps={STEPS}",
        "train.eval_interval=2",
        "data.valid_samples=4",
        "train.lr=3e-3",
        "train.warmup_steps=0",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    status, out = _main([*common, f"train.save_dir={straight}", "train.save_interval=1"], capsys)
    assert status == 0 and "ema_loss" in out, out[-3000:]
    valid = [json.loads(l) for l in (straight / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in valid if r["split"] == "valid"]
    assert [r["step"] for r in valid] == [2, 4] and all(r["ema_loss"] != r["loss"] for r in valid)

    _check_closed_form(straight, STEPS)
    # stop at step 2 (asynchronous save) and resume: the same average and weights, bit for bit (the promise)
    async_ = [*common, f"train.save_dir={split}", "train.async_save=true"]
    status, out = _main([*async_, "train.stop_after=2"], capsys)
    assert status == 0 and "stopped at step 2" in out, out[-3000:]
    assert (split / "step_00000002" / "ema").is_dir()
    status, out = _main(async_, capsys)
    assert status == 0 and "resumed from" in out, out[-3000:]
    last = split / f"step_{STEPS:08d}"
    for weights in ("live", "ema"):
        a, b = _params(straight / f"step_{STEPS:08d}", weights), _params(last, weights)
        # bit-exact: resume is the promise
        assert all(torch.equal(a[n], b[n]) for n in a), weights

    # evaluation and export read the average; a checkpoint without one is a one-line error, exit 2
    from megahash.accelerator import process_groups
    from megahash.convert.export import main as export_main
    from megahash.eval.lm import MegahashEvalLM

    ema = _params(last, "ema")
    lm = MegahashEvalLM(checkpoint=str(last), weights="ema", batch_size=2)
    got = dict(lm.model.named_parameters())
    # bit-exact: the checkpoint's stored floats loaded back
    assert all(torch.equal(got[n].detach().double(), ema[n]) for n in ema)
    del lm
    process_groups.teardown()
    assert (
        export_main(["--checkpoint", str(last), "--output", str(tmp_path / "hf"), "--weights", "ema", "--no-verify"])
        == 0
    )
    assert "(ema weights)" in capsys.readouterr().out
    from megahash.checkpoint.artifact import read_artifact
    from megahash.cli import main as cli

    assert cli(["export", "--checkpoint", str(last), "--output", str(tmp_path / "q"), "--weights", "ema"]) == 0
    back, rec = read_artifact(tmp_path / "q")  # int8 + zstd of the average: within half a step of it per row
    assert rec["meta"]["weights"] == "ema" and rec["format"] == "int8"
    for n, v in back.items():
        if n in ema:
            assert float((v.double() - ema[n]).abs().max()) <= float(ema[n].abs().max()) / 127 / 2 * 1.001 + 1e-12, n
    bare = tmp_path / "bare" / "step_00000004"
    shutil.copytree(last, bare)
    shutil.rmtree(bare / "ema")
    from megahash.checkpoint.manifest import write_manifest

    write_manifest(bare)  # as a run without train.ema.decay writes it (a missing listed file is damage)
    capsys.readouterr()
    assert export_main(["--checkpoint", str(bare), "--output", str(tmp_path / "hf2"), "--weights", "ema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "train.ema.decay" in err[0], err


@pytest.mark.slow
def test_ema_on_zero3_partitions(shakespeare_shards, tmp_path, capsys):
    """ZeRO-3 keeps the average over each rank's partition (ds_tensor): the closed form holds, validation
    swaps it in, and a resume from step 1 continues it bit-exactly."""
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [
        *data,
        *TINIER,
        "train.zero_stage=3",
        f"train.ema.decay={DECAY}",
        "train.steps=2",
        "train.eval_interval=2",
        "data.valid_samples=4",
        "train.lr=3e-3",
        "train.warmup_steps=0",
    ]
    a, b = tmp_path / "a", tmp_path / "b"
    status, out = _main([*common, f"train.save_dir={a}", "train.save_interval=1"], capsys)
    assert status == 0 and "ZeRO-3" in out and "ema_loss" in out, out[-3000:]
    _check_closed_form(a, 2)
    status, out = _main([*common, f"train.save_dir={b}", f"train.resume={a / 'step_00000001'}"], capsys)
    assert status == 0 and "resumed from" in out, out[-3000:]
    for weights in ("live", "ema"):
        x, y = _params(a / "step_00000002", weights), _params(b / "step_00000002", weights)
        # bit-exact: resume is the promise
        assert all(torch.equal(x[n], y[n]) for n in x), weights


def _valid_and_train(run_dir) -> tuple[dict, dict]:
    """{step: valid record}, {step: train loss} of a run's metrics.jsonl."""
    valid, train = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "valid":
            valid[rec["step"]] = rec
        elif rec["split"] == "train":
            train[rec["step"]] = rec["loss"]
    return valid, train


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ema_validation_at_two_zero3_ranks_is_the_averages(shakespeare_shards, tmp_path):
    """At 2 data-parallel ranks DeepSpeed's ZeRO-3 keeps the parameters the first validation pass gathered and
    reused them for the averages' pass, so ``ema_loss`` was the live ``loss`` (and once swapped in, the next
    training step would have run on the averages). ZeRO-1 at the same 2 ranks holds whole parameters: its
    ``ema_loss`` and its training losses are the independent reference."""
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINY, "train.steps=4", "train.eval_interval=2", "data.valid_samples=16", "train.ema.decay=0.5"]
    dirs = {z: tmp_path / f"zero{z}" for z in (1, 3)}
    runs = [[*common, f"train.zero_stage={z}", f"train.save_dir={d}"] for z, d in dirs.items()]
    for r in pretrain_group(runs, timeout=300):
        assert r.returncode == 0, r.stderr[-3000:]
    (v1, t1), (v3, t3) = (_valid_and_train(d) for d in dirs.values())
    for step in (2, 4):
        assert abs(v3[step]["ema_loss"] - v3[step]["loss"]) > 1e-3, v3[step]  # the averages lag the weights
        assert abs(v3[step]["ema_loss"] - v1[step]["ema_loss"]) < 1e-5, (v1[step], v3[step])
    assert sorted(t3) == [1, 2, 3, 4] and all(abs(t3[s] - t1[s]) < 1e-5 for s in t1), (t1, t3)


def test_ema_warmup_correction_against_its_closed_form():
    """timm's correction d_n = min(d, (1 + n) / (10 + n)): ema_k = (prod d_j) w_0 + sum_i (1 - d_i) prod_{j>i} d_j w_i."""
    torch.manual_seed(0)
    from megahash.training.ema import WeightEMA

    m = torch.nn.Linear(5, 3)
    ema = WeightEMA(m, 0.95, warmup=True)
    assert [ema.decay_at(n) for n in (0, 1, 90, 1000)] == [0.1, 2 / 11, 0.91, 0.95]
    ws = [m.weight.detach().double().clone()]
    for n in range(6):
        with torch.no_grad():
            m.weight.add_(torch.randn(3, 5))
        ws.append(m.weight.detach().double().clone())
        ema.update(n)
    d = [min(0.95, (1 + n) / (10 + n)) for n in range(6)]
    want = math.prod(d) * ws[0] + sum((1 - d[i]) * math.prod(d[i + 1 :]) * ws[i + 1] for i in range(6))
    # fp32: 2 roundings per update (|rel| <= 2^-24 each) on values of the weights' size
    tol = 4 * 6 * 2.0**-24 * max(max(float(w.abs().max()) for w in ws), 1.0)
    assert float((ema.avg[0].double() - want).abs().max()) <= tol
