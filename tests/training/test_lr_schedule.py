"""LR schedule (megatron-core's OptimizerParamScheduler driven per optimizer step,
megahash/training/lr_schedule.py) against closed forms written here from the formulas and against a plain
OptimizerParamScheduler (the reference implementation of lr-decay-iters, warmup fraction and WSD)."""

import math
import types

import pytest
import torch

from megahash.config import load_config
from megahash.errors import ConfigError
from megahash.training.lr_schedule import Schedule, lr_for_step, warmup_steps_of


def _t(**kw):
    return load_config(None, [f"train.{k}={v}" for k, v in kw.items()]).train


def test_cosine_closed_form_and_decay_length_decoupled_from_steps():
    t = _t(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine", steps=50, decay_steps=110)
    assert lr_for_step(t, 0) == pytest.approx(0.1)  # (0+1)/10
    assert lr_for_step(t, 9) == pytest.approx(1.0)
    assert lr_for_step(t, 10) == pytest.approx(1.0)  # ratio 0
    assert lr_for_step(t, 60) == pytest.approx(0.1 + 0.9 * 0.5)  # ratio 1/2: cos(pi/2) = 0
    assert lr_for_step(t, 35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_for_step(t, 110) == pytest.approx(0.1) and lr_for_step(t, 500) == pytest.approx(0.1)
    # extending the run (more steps) does not reshape the curve once decay_steps is set
    longer = _t(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine", steps=200, decay_steps=110)
    assert [lr_for_step(longer, s) for s in range(120)] == [lr_for_step(t, s) for s in range(120)]
    # decay_steps=0 keeps the old meaning (decay over train.steps); cosine to 0 is allowed
    zero = _t(lr=1.0, min_lr=0, warmup_steps=0, decay="cosine", steps=100)
    assert lr_for_step(zero, 50) == pytest.approx(0.5) and lr_for_step(zero, 100) == 0.0


def test_wsd_and_warmup_fraction_closed_form():
    t = _t(lr=2.0, min_lr=0.0, warmup_fraction=0.05, decay="wsd", decay_fraction=0.2, steps=200)
    assert warmup_steps_of(t) == 10
    assert lr_for_step(t, 4) == pytest.approx(2.0 * 5 / 10)
    assert lr_for_step(t, 10) == lr_for_step(t, 159) == lr_for_step(t, 160) == 2.0  # stable until D - 0.2 D
    assert lr_for_step(t, 180) == pytest.approx(1.0)  # linear anneal half way
    assert lr_for_step(t, 200) == 0.0
    sq = _t(lr=2.0, min_lr=0.0, warmup_steps=10, decay="wsd", decay_fraction=0.2, wsd_decay_style="1-sqrt", steps=200)
    assert lr_for_step(sq, 170) == pytest.approx(2.0 * (1 - math.sqrt(0.25)))


@pytest.mark.parametrize(
    "style, mstyle, wsd",
    [
        ("cosine", "cosine", "linear"),
        ("linear", "linear", "linear"),
        ("wsd", "WSD", "linear"),
        ("wsd", "WSD", "cosine"),
        ("wsd", "WSD", "1-sqrt"),
    ],
)
def test_matches_megatron_optimizer_param_scheduler(style, mstyle, wsd):
    """Megatron counts steps from 1 in warmup (its LR at num_steps=s is ours at s-1) and from the
    same origin after it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    W, D, F = 7, 60, 0.25
    t = _t(
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=W,
        decay=style,
        decay_steps=D,
        steps=80,
        decay_fraction=F,
        wsd_decay_style=wsd,
    )
    opt = types.SimpleNamespace(param_groups=[{}])
    ref = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=3e-3,
        min_lr=3e-4,
        lr_warmup_steps=W,
        lr_decay_steps=D,
        lr_decay_style=mstyle,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=D,
        wd_incr_style="linear",
        wsd_decay_steps=int(round(F * D)),
        lr_wsd_decay_style={"1-sqrt": "minus_sqrt"}.get(wsd, wsd),
    )
    for s in range(1, 80):
        ref.step(1)  # num_steps = s
        mine = lr_for_step(t, s - 1) if s <= W else lr_for_step(t, s)
        assert mine == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), s


def _wsd_closed_form(s, lr, min_lr, warmup, total, fraction):
    """Warmup ``lr (s + 1) / W``, stable ``lr``, linear anneal over the last ``fraction`` of ``total``."""
    if s < warmup:
        return lr * (s + 1) / warmup
    if s >= total:
        return min_lr
    n = max(1, round(fraction * total))
    return lr if s < total - n else min_lr + (lr - min_lr) * (1 - (s - (total - n)) / n)


def test_schedule_sets_every_group_and_keeps_their_weight_decay():
    """The engine's scheduler on a real optimizer: the AdamW groups follow train.lr's schedule, a group of
    another peak (Muon's train.muon.lr) the same shape scaled to its peak, every group's weight decay stays."""
    t = _t(lr=1e-3, min_lr=1e-4, warmup_steps=3, decay="wsd", decay_fraction=0.5, steps=20)
    ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD(
        [
            {"params": [ps[0]], "weight_decay": 0.1},
            {"params": [ps[1]], "weight_decay": 0.0},
            {"params": [ps[2]], "lr": 2e-2, "weight_decay": 0.1},
        ],
        lr=t.lr,
    )
    sched = Schedule(opt, t)
    for s in range(25):
        want = _wsd_closed_form(s, 1e-3, 1e-4, 3, 20, 0.5)
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs[0] == lrs[1] == pytest.approx(want, rel=1e-12), s
        assert lrs[2] == pytest.approx(want * 20, rel=1e-12), s  # floor 2e-2 * min_lr / lr
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0, 0.1]
        opt.step()
        sched.step()


def test_decay_ending_within_warmup_warms_up_then_holds_min_lr():
    """D <= W (megatron's scheduler requires W < D): warmup, then min_lr from step W (constant: lr)."""
    t = _t(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine", steps=20, decay_steps=6)
    assert [lr_for_step(t, s) for s in (0, 9, 10, 15)] == pytest.approx([0.1, 1.0, 0.1, 0.1], rel=1e-12)
    c = _t(lr=1.0, min_lr=0.1, warmup_steps=10, decay="constant", steps=20, decay_steps=6)
    assert [lr_for_step(c, s) for s in (4, 10, 15)] == pytest.approx([0.5, 1.0, 1.0], rel=1e-12)


@pytest.mark.parametrize("ramp", [False, True])
def test_resumed_schedule_continues_bit_exactly(ramp):
    """A scheduler loaded from another's state_dict at step k (what DeepSpeed's checkpoint holds) gives the
    uninterrupted run's LRs, bit for bit (resume is the promise), with and without a batch-size ramp."""
    over = dict(
        lr=2e-3, min_lr=2e-4, warmup_steps=4, decay="wsd", decay_fraction=0.3, wsd_decay_style="1-sqrt", steps=30
    )
    if ramp:
        over.update(batch_ramp="[2,2,24]", global_batch_size=8, micro_batch_size=2)
    t = _t(**over)

    def sgd():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)

    opt = sgd()
    sched = Schedule(opt, t)
    straight, state = [], None
    for s in range(30):
        straight.append(opt.param_groups[0]["lr"])
        sched.step()
        if s == 10:
            state = sched.state_dict()
    opt2 = sgd()
    resumed = Schedule(opt2, t)
    resumed.load_state_dict(state)
    after = []
    for _ in range(11, 30):
        after.append(opt2.param_groups[0]["lr"])
        resumed.step()
    assert after == straight[11:]


@pytest.mark.parametrize(
    "override, expect",
    [
        ("train.decay=wsdd", "must be cosine, linear, wsd or constant"),
        ("train.wsd_decay_style=sqrt", "must be linear, cosine or 1-sqrt"),
        ("train.decay_fraction=0", "'train.decay_fraction' must be in (0.0, 1.0]"),
        ("train.min_lr=1", "must be <= train.lr"),
    ],
)
def test_schedule_config_errors(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", [override])
    assert expect in str(e.value) and "\n" not in str(e.value)
