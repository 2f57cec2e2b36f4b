"""Batch-size ramp (``train.batch_ramp``, Megatron's ``--rampup-batch-size START INCREMENT SAMPLES``).

Facts checked against independent references: the per-step global batch and consumed samples against
the ramp's formula written out here; the LR of every step against the schedule in samples written out
here in fp64 and against megatron-core's ``OptimizerParamScheduler`` driven by the ramp's batches (what
Megatron's training loop does); DeepSpeed's own step and sample counters; a run stopped inside the ramp
and resumed equals the uninterrupted run bit-exactly (losses, gradient norms, LR, weights). One rank in
this process through the pretraining entry point (the ramp grows the gradient accumulation steps at one
data-parallel rank just as at several)."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from conftest import TINIER, pretrain_group
from megahash.config import load_config
from megahash.errors import ConfigError

# micro-batch 2, global batch 8, ramp 2 -> 8 by 2 over 24 samples: 3 increments of 8 samples each
RAMP = ["train.micro_batch_size=2", "train.global_batch_size=8", "train.batch_ramp=[2,2,24]"]
SCHEDULE = ["train.lr=2e-3", "train.min_lr=2e-4", "train.warmup_steps=2", "train.decay=cosine", "train.decay_steps=9"]
STEPS = 10


def ramp_batch(consumed: int, start=2, inc=2, samples=24, gbs=8) -> int:
    """Megatron's rule: START + INCREMENT x floor(c / (SAMPLES / n)), n = (G - START) / INCREMENT; G past SAMPLES."""
    if consumed > samples:
        return gbs
    return start + inc * math.floor(consumed / (samples / ((gbs - start) // inc)))


def expected_consumed(steps: int) -> list[int]:
    out = [0]
    for _ in range(steps):
        out.append(out[-1] + ramp_batch(out[-1]))
    return out


def lr_in_samples(step: int, lr=2e-3, min_lr=2e-4, warmup=2, decay=9) -> float:
    """fp64 closed form, lengths in samples (c_W, c_D: the samples of the first W, D steps): warmup
    lr c_{s+1} / c_W, then cosine over (c_s - c_W) / (c_D - c_W), min_lr past c_D."""
    c = expected_consumed(max(step + 1, decay))
    if step < warmup:
        return lr * c[step + 1] / c[warmup]
    ratio = min(1.0, (c[step] - c[warmup]) / (c[decay] - c[warmup]))
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))


def test_batches_and_lr_follow_the_ramp_formula_and_megatron():
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megahash.data.samples import consumed_samples, step_batch
    from megahash.training.lr_schedule import lr_for_step

    t = load_config(None, [*RAMP, *SCHEDULE, "train.steps=40"]).train
    assert [step_batch(t, s) for s in range(10)] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8]
    assert [consumed_samples(t, s) for s in range(41)] == expected_consumed(40)
    assert all(lr_for_step(t, s) == pytest.approx(lr_in_samples(s), rel=1e-12) for s in range(40))
    # Megatron under a ramp counts the schedule in samples (lengths c_W = 4, c_D = 36 here) and advances it by
    # each step's batch; its LR at num_steps = c_s is ours of step s after warmup, at c_{s+1} in warmup
    # (megahash's (s + 1) / W rule)
    assert consumed_samples(t, 2) == 4 and consumed_samples(t, 9) == 36
    opt = types.SimpleNamespace(param_groups=[{}])
    ref = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=2e-3,
        min_lr=2e-4,
        lr_warmup_steps=4,
        lr_decay_steps=36,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=36,
        wd_incr_style="constant",
    )
    for s in range(40):
        before = opt.param_groups[0]["lr"]
        ref.step(step_batch(t, s))
        assert lr_for_step(t, s) == pytest.approx(opt.param_groups[0]["lr"] if s < 2 else before, rel=1e-12), s
    # without a ramp the step schedule is unchanged
    plain = load_config(None, [*SCHEDULE, "train.steps=40"]).train
    assert consumed_samples(plain, 7) == 7 * plain.global_batch_size and lr_for_step(plain, 0) == 2e-3 / 2


@pytest.mark.parametrize(
    "ramp, expect",
    [
        ("[2,2]", "must be [START, INCREMENT, SAMPLES]"),
        ("[2,0,24]", "must be >= 1"),
        (
            "[3,1,24]",
            "START 3 is not a multiple of train.micro_batch_size x data-parallel size = 2 x 1; pick a multiple of 2",
        ),
        ("[2,3,24]", "INCREMENT 3 is not a multiple"),
        ("[8,2,24]", "START 8 must be below train.global_batch_size=8"),
        (
            "[2,4,24]",
            "INCREMENT 4 does not divide train.global_batch_size - START = 8 - 2 = 6; pick INCREMENT among [2, 6]",
        ),
    ],
)
def test_bad_ramp_is_one_line(ramp, expect):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=8", f"train.batch_ramp={ramp}"])
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_ramp_multiple_of_data_parallel_size_once_the_world_is_known():
    from megahash.training.ds_config import deepspeed_config

    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=16", "train.batch_ramp=[2,2,24]"])
    deepspeed_config(cfg, 1, bf16=False)
    with pytest.raises(ConfigError, match="START 2 is not a multiple of .* = 2 x 2; pick a multiple of 4"):
        deepspeed_config(cfg, 2, bf16=False)


def _records(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            out[rec["step"]] = rec
    return out


def _main(args: list[str], capsys) -> tuple[int, str]:
    from megahash.pretrain import main

    status = main(args)
    cap = capsys.readouterr()
    return status, cap.out + cap.err


def _ds_state(ckpt: Path) -> dict:
    import torch

    return torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)


def test_resume_inside_the_ramp_equals_the_uninterrupted_run(shakespeare_shards, tmp_path, capsys):
    """10 straight steps (batches 2, 2, 2, 2, 4, 4, 6, 6, 8, 8) == 5 steps, stop (batch 4 next), resume
    for 5; consumed samples, batches, LR and DeepSpeed's counters as the formulas say."""
    import torch

    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINIER, *RAMP, *SCHEDULE, f"train.steps={STEPS}"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    status, out = _main([*common, f"train.save_dir={straight}"], capsys)
    assert status == 0, out[-3000:]
    status, out = _main([*common, f"train.save_dir={split}", "train.stop_after=5"], capsys)
    assert status == 0 and "stopped at step 5" in out, out[-3000:]
    state = json.loads((split / "step_00000005" / "megahash_state.json").read_text())
    assert state["step"] == 5 and state["consumed_samples"] == expected_consumed(5)[-1] == 12
    status, out = _main([*common, f"train.save_dir={split}"], capsys)
    assert status == 0 and f"resumed from {split}/step_00000005" in out, out[-3000:]

    a, b = _records(straight), _records(split)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    consumed = expected_consumed(STEPS)
    for s in range(1, STEPS + 1):
        assert a[s]["consumed_samples"] == consumed[s] and a[s]["consumed_tokens"] == consumed[s] * 32, s
        assert a[s]["global_batch"] == ramp_batch(consumed[s - 1]), s
        assert a[s]["lr"] == pytest.approx(lr_in_samples(s - 1), rel=1e-12), s  # the LR step s used
    # bit-exact: resume is the promise (same configuration in process, same machine)
    keys = ("loss", "grad_norm", "param_norm", "lr", "consumed_samples", "global_batch")
    assert [[a[s][k] for k in keys] for s in a] == [[b[s][k] for k in keys] for s in b]
    one, two = _ds_state(straight / "step_00000010"), _ds_state(split / "step_00000010")
    # DeepSpeed took one optimizer step per megahash step, counting each step's batch (its accumulation)
    assert one["global_steps"] == two["global_steps"] == STEPS
    assert one["global_samples"] == two["global_samples"] == consumed[-1]
    weights = {k: v for k, v in one["module"].items() if torch.is_tensor(v)}
    assert one["module"].keys() == two["module"].keys() and len(weights) > 5
    # bit-exact: resume inside the ramp is the promise (same path, same machine)
    assert all(torch.equal(v, two["module"][k]) for k, v in weights.items())

    # another ramp cannot continue this checkpoint (its data and LR would move): one line, exit 2
    status, out = _main(
        [
            *data,
            *TINIER,
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "train.batch_ramp=[4,2,24]",
            *SCHEDULE,
            f"train.steps={STEPS}",
            f"train.save_dir={split}",
            f"train.resume={split / 'step_00000005'}",
        ],
        capsys,
    )
    assert status == 2, out[-3000:]
    line = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "consumed 12 samples in 5 steps" in line[0] and "give 24" in line[0], out[-3000:]


def test_another_global_batch_without_a_ramp_is_refused_not_resumed_past_unread_samples(
    shakespeare_shards, tmp_path, capsys
):
    """No ramp: a resume at another train.global_batch_size would start reading at step x G of the new G (16
    samples saved after 2 steps of 8; 2 x 16 = 32 read next: samples 16..31 never trained on, the logged
    consumed_samples 16 too high). It is one line, exit 2, naming both numbers; the run folder is left as it was."""
    data = [f"data.prefix=[{shakespeare_shards['prefix']}]", f"data.tokenizer={shakespeare_shards['tokenizer']}"]
    common = [*data, *TINIER, "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=4"]
    run = tmp_path / "run"
    status, out = _main([*common, f"train.save_dir={run}", "train.stop_after=2"], capsys)
    assert status == 0 and "stopped at step 2" in out, out[-3000:]
    before = (run / "metrics.jsonl").read_bytes()
    status, out = _main([*common, f"train.save_dir={run}", "train.global_batch_size=16"], capsys)
    assert status == 2, out[-3000:]
    line = [l for l in out.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and "consumed 16 samples in 2 steps" in line[0] and "give 32" in line[0], out[-3000:]
    assert "batch_ramp" not in line[0] and "Traceback" not in out
    assert (run / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000002"]
    # another micro-batch (gradient accumulation) at the same global batch is no other data order: it resumes
    status, out = _main([*common, f"train.save_dir={run}", "train.micro_batch_size=4"], capsys)
    assert status == 0 and f"resumed from {run}/step_00000002" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_data_parallel_ranks_ramp_like_one(shakespeare_shards, tmp_path, capsys):
    """Ramp [4,4,16] to 8 at micro-batch 2: 2 ranks under ZeRO-1 (partitioned optimizer; 1 then 2
    accumulation steps) and 1 rank (2 then 4) take the same samples per step: same consumed samples,
    batches and LR, losses within 1e-5 (fp32; the DP all-reduce sums in another order; measured 2.4e-7),
    and DeepSpeed counts the same steps and samples."""
    common = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINIER,
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "train.batch_ramp=[4,4,16]",
        *SCHEDULE,
        "train.steps=6",
        "train.zero_stage=1",
    ]
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    status, out = _main([*common, f"train.save_dir={one}"], capsys)
    assert status == 0, out[-3000:]
    (r,) = pretrain_group([[*common, f"train.save_dir={two}"]])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    a, b = _records(one), _records(two)
    assert (
        [a[s]["global_batch"] for s in range(1, 7)] == [b[s]["global_batch"] for s in range(1, 7)] == [4] * 4 + [8] * 2
    )
    for s in range(1, 7):
        assert a[s]["consumed_samples"] == b[s]["consumed_samples"] and a[s]["lr"] == b[s]["lr"], s
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-5, (s, a[s]["loss"], b[s]["loss"])
    ds1, ds2 = _ds_state(one / "step_00000006"), _ds_state(two / "step_00000006")
    assert ds1["global_steps"] == ds2["global_steps"] == 6 and ds1["global_samples"] == ds2["global_samples"] == 32
