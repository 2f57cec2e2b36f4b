"""train.optimizer=muon (megahash/training/muon.py): one step equals torch.optim.Muon on the hidden matrices +
torch.optim.AdamW on the rest; Newton-Schulz runs on every routed matrix through the real DeepSpeed engine at
every ZeRO stage megahash runs it at (ZeRO-3 refused in one line); stop + resume is bit-exact under bf16 and the
optimizer phase's time is in the progress line; the momentum follows an elastic resume. Sharded over data-parallel
ranks (train.zero_stage 1/2, megahash/training/muon_sharded.py): the assignment of the matrices, every step equal to
single-rank Muon, each rank holding and computing only its share, exact and elastic resume (2 -> 1, 1 -> 2, 4 -> 2)
with asynchronous saves and an EMA. NorMuon (train.muon.normuon): its step against the paper's formula in fp64, its
row moments saved and resumed bit for bit, sharded like the momentum. Multi-rank tests run gloo processes on the CPU:
about 2 minutes each here."""

import json
import math
import re

import pytest
import torch

import conftest
from conftest import pretrain_group, train_losses

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

TINY = [
    *conftest.TINIER,
    "model.num_layers=2",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=2e-3",
    "train.warmup_steps=1",
    "train.log_interval=10",
    "train.zero_stage=1",
    "train.optimizer=muon",
    "train.muon.lr=0.02",
]
# the attention and MLP projections of megatron-core's layers, by name (independent of muon.routes_to_muon)
HIDDEN = re.compile(r"decoder\.layers\.\d+\.(self_attention\.linear_(q|kv|qkv|proj)|mlp\.linear_fc[12])\.weight")


def _data(shards) -> list[str]:
    return [f"data.prefix=[{shards['prefix']}]", f"data.tokenizer={shards['tokenizer']}"]


@pytest.fixture
def ns_calls():
    """Shapes of the matrices Newton-Schulz ran on (megahash.training.muon.counting_newton_schulz)."""
    from megahash.training import muon

    with muon.counting_newton_schulz() as calls:
        yield calls


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_two_steps_equal_torch_muon_plus_adamw(dist, adjust):
    """From the same weights and gradients: the routed matrices step as torch.optim.Muon, the rest as
    torch.optim.AdamW (decay on 2-D, none on 1-D); two steps, so the momentum buffer carries."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model
    from megahash.training.muon import build_optimizer, routes_to_muon
    from megahash.training.param_groups import param_groups

    cfg = load_config(None, [*TINY, "model.vocab_size=100", "train.weight_decay=0.1", f"train.muon.adjust_lr={adjust}"])
    t = cfg.train
    rng.seed_all(t.seed)
    ours = build_model(cfg, 100)
    ref = build_model(cfg, 100)
    ref.load_state_dict(ours.state_dict())
    route = routes_to_muon(ours)
    assert {n for n, r in route.items() if r} == {n for n, _ in ours.named_parameters() if HIDDEN.fullmatch(n)}
    assert not any(route[n] for n in route if "embedding" in n or "layernorm" in n or n.endswith("bias"))
    opt = build_optimizer(ours, t, param_groups(ours, t), {})
    named = dict(ref.named_parameters())
    hidden = [p for n, p in named.items() if route[n]]
    rest = [p for n, p in named.items() if not route[n]]
    ref_muon = torch.optim.Muon(
        hidden,
        lr=t.muon.lr,
        weight_decay=t.weight_decay,
        momentum=t.muon.momentum,
        nesterov=t.muon.nesterov,
        ns_steps=t.muon.ns_steps,
        adjust_lr_fn=adjust,
    )
    ref_adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.ndim >= 2], "weight_decay": t.weight_decay},
            {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for a, b in zip(ours.parameters(), ref.parameters()):
            g = torch.randn(a.shape, generator=gen, dtype=torch.float64).float()
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        # fp32 weights of unit scale after steps of lr <= 0.02 x 1.6: 1e-6 is ~10 ulps (AdamW fused vs foreach,
        # Muon identical operations on identical inputs)
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    assert all(opt.state[p]["momentum_buffer"].abs().sum() > 0 for p in opt.param_groups[-1]["params"])


def test_momentum_warmup_follows_the_optimizer_step_as_modded_nanogpt_schedules_it(dist):
    """train.muon.momentum_warmup_steps=W: the momentum of 0-based step s is start + (momentum - start) s / W
    while s < W, then momentum (modded-nanogpt's get_muon_momentum, 0.85 -> 0.95 over 300 steps there), set
    by the schedule from the step (go_to, as a resume does); three steps equal torch.optim.Muon stepped at
    those momenta."""
    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model
    from megahash.training.lr_schedule import Schedule
    from megahash.training.muon import build_optimizer, routes_to_muon
    from megahash.training.param_groups import param_groups

    warm = ["train.muon.momentum_warmup_steps=2", "train.muon.momentum_start=0.6", "train.muon.momentum=0.9"]
    cfg = load_config(None, [*TINY, "model.vocab_size=100", "train.steps=8", *warm])
    t = cfg.train
    expect = [0.6, 0.75, 0.9, 0.9]  # 0.6 + (0.9 - 0.6) * s / 2, then 0.9
    rng.seed_all(t.seed)
    ours = build_model(cfg, 100)
    ref = build_model(cfg, 100)
    ref.load_state_dict(ours.state_dict())
    opt = build_optimizer(ours, t, param_groups(ours, t), {})
    schedule = Schedule(opt, t)
    group = next(g for g in opt.param_groups if g["use_muon"])
    assert [(schedule.go_to(s), group["momentum"])[1] for s in (3, 1, 0, 2)] == pytest.approx(
        [expect[3], expect[1], expect[0], expect[2]], abs=1e-12
    )
    route = routes_to_muon(ours)
    hidden = [p for n, p in ref.named_parameters() if route[n]]
    ref_muon = torch.optim.Muon(hidden, lr=t.muon.lr, weight_decay=t.weight_decay, momentum=expect[0])
    gen = torch.Generator().manual_seed(0)
    for s in range(3):
        schedule.go_to(s)
        ref_muon.param_groups[0].update(lr=group["lr"], momentum=expect[s])
        for a, b in zip(ours.parameters(), ref.parameters()):
            g = torch.randn(a.shape, generator=gen, dtype=torch.float64).float()
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_muon.step()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        if route[name]:  # identical operations on identical inputs: 1e-6 is ~10 ulps of these weights
            assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    # without the warm-up (the default) the momentum is train.muon.momentum from step 0
    plain = load_config(None, [*TINY, "model.vocab_size=100"]).train
    opt = build_optimizer(ours, plain, param_groups(ours, plain), {})
    Schedule(opt, plain).go_to(0)
    assert next(g for g in opt.param_groups if g["use_muon"])["momentum"] == plain.muon.momentum == 0.95


def test_a_resumed_optimizer_takes_this_runs_muon_settings_not_the_checkpoints(dist):
    """An optimizer state_dict carries each group's settings, and torch's load_state_dict puts them back (as
    DeepSpeed's resume does): a run resumed with another ``train.muon.orthogonalizer``, ``ns_steps``,
    ``nesterov`` or momentum steps with its own config's, set by the schedule at the resume step."""
    from torch.optim import _muon

    from megahash.accelerator import rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model
    from megahash.training.lr_schedule import Schedule
    from megahash.training.muon import POLAR_EXPRESS, build_optimizer
    from megahash.training.param_groups import param_groups

    before = load_config(None, [*TINY, "model.vocab_size=100"]).train
    after = load_config(
        None,
        [
            *TINY,
            "model.vocab_size=100",
            "train.muon.orthogonalizer=polar_express",
            "train.muon.ns_steps=6",
            "train.muon.nesterov=false",
            "train.muon.momentum=0.9",
        ],
    ).train
    rng.seed_all(before.seed)
    model = build_model(load_config(None, [*TINY, "model.vocab_size=100"]), 100)
    saved = build_optimizer(model, before, param_groups(model, before), {}).state_dict()
    opt = build_optimizer(model, after, param_groups(model, after), {})
    opt.load_state_dict(saved)
    group = next(g for g in opt.param_groups if g["use_muon"])
    default = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    assert tuple(group["ns_coefficients"]) == default and group["ns_steps"] == 5  # the checkpoint's, loaded
    Schedule(opt, after).go_to(4)
    assert group["ns_coefficients"] == POLAR_EXPRESS and group["ns_steps"] == 6
    assert group["nesterov"] is False and group["momentum"] == 0.9


def _of_condition(rows: int, cols: int, kappa: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random rows x cols matrix with singular values geometric from 1 to 1 / kappa (fp64), and its exact
    polar factor U V^T."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=gen, dtype=torch.float64))
    k = min(rows, cols)
    s = torch.logspace(0, -math.log10(kappa), k, dtype=torch.float64)
    return u[:, :k] @ torch.diag(s) @ v[:, :k].T, u[:, :k] @ v[:, :k].T


@pytest.mark.parametrize("shape", [(64, 192), (192, 64)])
def test_polar_express_lands_every_singular_value_near_one_closer_to_the_polar_factor(shape):
    """train.muon.orthogonalizer=polar_express (Amsel et al. 2025, modded-nanogpt's table): for matrices of
    condition 100 (wide and tall), in bf16 as Muon runs it, the singular values of the output (fp64 SVD) lie
    within the band the five minimax quintics map [1e-3, 1] into (1 +- 0.1412, their fp64 composition, a
    property of the coefficients: one polynomial applied to every singular value), where torch's fixed quintic
    leaves the smallest near 0.68 ([Jordan24]'s roughly (0.7, 1.2)); and the output is closer to the exact
    polar factor U V^T in the same five steps."""
    from torch.optim import _muon

    from megahash.training.muon import POLAR_EXPRESS, newton_schulz

    x = torch.linspace(1e-3, 1 / 1.02, 20001, dtype=torch.float64)
    y = x.clone()
    for a, b, c in POLAR_EXPRESS:
        y = a * y + b * y**3 + c * y**5
    assert 1 - 0.1412 < float(y.min()) and float(y.max()) < 1 + 0.1412  # the table's band, in fp64
    default = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    for seed in range(3):
        g, polar = _of_condition(*shape, 100.0, seed)
        pe = newton_schulz(g.float(), 5, POLAR_EXPRESS, _muon.EPS).double()
        ns = newton_schulz(g.float(), 5, default, _muon.EPS).double()
        sv_pe, sv_ns = torch.linalg.svdvals(pe), torch.linalg.svdvals(ns)
        # bf16 iterations: a few bf16 roundings (2^-8 relative) of the band's edges
        assert 1 - 0.16 < float(sv_pe.min()) and float(sv_pe.max()) < 1 + 0.16, sv_pe.aminmax()
        assert float(sv_ns.min()) < 0.75  # the default's band is wider: a fact this test's contrast rests on
        err_pe, err_ns = float(torch.linalg.norm(pe - polar)), float(torch.linalg.norm(ns - polar))
        assert err_pe < 0.8 * err_ns, (err_pe, err_ns)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_newton_schulz_on_every_routed_matrix_through_the_engine(shakespeare_shards, tmp_path, dist, ns_calls, stage):
    """One step through the DeepSpeed engine at each stage megahash runs Muon at (1 and 2 at one fp32
    data-parallel rank run as stage 0): NS once per routed matrix, none on anything else."""
    from megahash.config import load_config
    from megahash.training.muon import routes_to_muon
    from megahash.training.profiling import TrainHarness

    cfg = load_config(
        None,
        [
            *_data(shakespeare_shards),
            *TINY,
            f"data.cache_dir={tmp_path}",
            f"train.zero_stage={stage}",
            "train.precision=fp32",
        ],
    )
    h = TrainHarness(cfg, 1)
    assert h.engine.zero_optimization_stage() == 0
    h.step()
    shapes = sorted(tuple(p.shape) for n, p in h.model.named_parameters() if routes_to_muon(h.model)[n])
    hidden = sorted(tuple(p.shape) for n, p in h.model.named_parameters() if HIDDEN.fullmatch(n))
    assert shapes == hidden, [n for n, p in h.model.named_parameters() if routes_to_muon(h.model)[n]]
    assert sorted(ns_calls) == shapes


def test_layouts_zero3_refused_in_one_line_zero12_run_sharded_on_the_engine_path():
    """ZeRO-3 at config time (one line, naming train.zero_stage=1); ZeRO-1/2 over data-parallel ranks run the engine
    at stage 0 (gradient all-reduce, clipping) with the optimizer sharded; DeepSpeed's bf16 optimizer refused."""
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.training.ds_config import deepspeed_config
    from megahash.training.muon import sharded

    with pytest.raises(ConfigError, match=r"ZeRO stage 3 partitions .* set train.zero_stage=1 ") as e:
        load_config(None, [*TINY, "train.zero_stage=3"])
    assert "\n" not in str(e.value)
    for stage in (1, 2):
        cfg = load_config(None, [*TINY, f"train.zero_stage={stage}", "train.micro_batch_size=1"])
        for dp in (1, 2, 4):
            assert deepspeed_config(cfg, dp_size=dp, bf16=False)["zero_optimization"]["stage"] == 0
            assert sharded(cfg.train, dp) == (dp > 1)
    assert not sharded(load_config(None, [*TINY, "train.zero_stage=0"]).train, 2)
    with pytest.raises(ConfigError, match="needs fp32 parameters"):
        deepspeed_config(load_config(None, [*TINY, "train.zero_stage=1"]), dp_size=2, bf16=True)


def test_assignment_balances_whole_matrices_whatever_their_order():
    """muon_sharded.assign: every matrix to one rank; the same owners for any order of registration; each rank's
    elements within Graham's list-scheduling bound (the mean plus the largest matrix) and, for the 70M model's
    matrices (configs/model/70m.yaml: 6 layers of q/k/v, proj, SwiGLU fc1, fc2), within 4/3 of the mean."""
    import random

    from megahash.training.muon_sharded import assign

    h, f = 512, 2048
    sizes = {}
    for l in range(6):
        sizes |= {f"l{l}.qkv": 3 * h * h, f"l{l}.proj": h * h, f"l{l}.fc1": 2 * f * h, f"l{l}.fc2": f * h}
    rng = random.Random(0)
    odd = {f"m{i}": rng.randrange(1, 10**5) for i in range(37)}
    for table in (sizes, odd):
        for ranks in (1, 2, 3, 4, 8):
            owners = assign(table, ranks)
            items = list(table.items())
            rng.shuffle(items)
            assert assign(dict(items), ranks) == owners  # independent of the order of registration
            assert set(owners) == set(table) and set(owners.values()) <= set(range(ranks))
            load = [sum(n for m, n in table.items() if owners[m] == r) for r in range(ranks)]
            mean = sum(table.values()) / ranks
            assert max(load) <= mean + max(table.values()), (ranks, load)
            if table is sizes:
                assert max(load) <= 4 / 3 * mean, (ranks, load)


def _spawn(worker: str, ranks: int, *args: str, timeout: int = 600) -> None:
    """Run tests/training/WORKER as ``ranks`` gloo processes; every one must exit 0."""
    import os
    import sys

    from conftest import local_world

    script = os.path.join(os.path.dirname(__file__), worker)
    done = local_world([sys.executable, script, *args], ranks, timeout=timeout)
    assert all(status == 0 for status, _ in done), "\n".join(out[-3000:] for _, out in done)


STEPS = 4
LEVERS = ["train.muon.momentum_warmup_steps=3", "train.muon.orthogonalizer=polar_express"]  # tp2dp2's


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_muon_steps_as_one_rank_holds_its_share_and_resumes_at_any_data_parallel_size(
    shakespeare_shards, tmp_path, capsys
):
    """train.optimizer=muon at ZeRO-1/2 over data-parallel ranks, gloo processes on the CPU (one run each, the checks
    combined: about 4 minutes here).

    The step (tests/training/muon_dp_worker.py, the trainer's engine): at DP 4 (ZeRO-2, fp32) and at TP 2 x DP 2
    (ZeRO-1, train.precision=bf16, the TP gather kept; with the momentum warm-up and Polar Express) every step
    equals single-rank Muon stepped beside it on the same gradients (at the warm-up's momentum of the step), bit
    for bit; per TP rank the data-parallel ranks ran Newton-Schulz on every routed matrix once
    between them, each only on its own matrices and holding the momentum of those only, its optimizer state its
    share; the 4-rank weights after 4 steps are the 1-rank run's within what the order of the gradient reduction
    can move them.

    The checkpoints (the momentum in optimizer/, each tensor whole): 2 ranks with asynchronous saves and an EMA,
    resumed from step 2, log steps 3-4 bit for bit, live and EMA weights too; resumed at another data-parallel size
    (2 -> 1, 1 -> 2, 4 -> 2), the momentum and AdamW's moments reassigned to the new owners, step 3 is the
    uninterrupted run's bit for bit and step 4 within the fp32 reduction order of one step's gradients, while a
    resume without the optimizer state lands far off."""
    from test_batch_ramp import _main
    from test_ema import _params

    common = [
        *_data(shakespeare_shards),
        *TINY,
        "train.micro_batch_size=1",
        "train.global_batch_size=4",  # 4 micro-batches: 4 accumulated on one rank, 1 on each of 4
        f"train.steps={STEPS}",
        "train.log_interval=1",
    ]
    runs = {  # name: (ranks, TP, overrides, the step it saves)
        "dp1": (1, 1, ["train.zero_stage=1"], 2),
        "dp4": (4, 1, ["train.zero_stage=2"], 2),
        "tp2dp2": (4, 2, ["train.zero_stage=1", "train.precision=bf16", *LEVERS], 0),
    }
    out = {}
    for name, (ranks, tp, extra, save_at) in runs.items():
        path = tmp_path / f"{name}.json"
        where = [f"train.save_dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'cache' / name}"]
        _spawn("muon_dp_worker.py", ranks, str(path), str(tp), str(STEPS), str(save_at), *common, *extra, *where)
        out[name] = json.loads(path.read_text())
    assert not out["dp1"]["sharded"] and len(out["dp1"]["losses"]) == STEPS
    for name in ("dp4", "tp2dp2"):
        r, tp = out[name], runs[name][1]
        dp = runs[name][0] // tp
        assert r["sharded"] and r["engine_stage"] == 0, name
        # bit-exact: the owner runs single-rank Muon's operations on the same inputs; the all-gather copies
        assert r["diffs"] == [0.0] * STEPS, (name, r["diffs"])
        shapes = r["shapes"]
        numel = {n: math.prod(s) for n, s in shapes.items()}
        muon_total = sum(numel[n] for n in r["routed"])
        adam = [
            sum(numel[n] for n, s in shapes.items() if n not in r["routed"] and (len(s) >= 2) == two) for two in (1, 0)
        ]
        for t in range(tp):
            ranks = [x for x in r["ranks"] if x["tp_rank"] == t]
            assert sorted(x["dp_rank"] for x in ranks) == list(range(dp))
            assert sorted(m for x in ranks for m in x["ns"]) == r["routed"], name  # every matrix, once
            for x in ranks:
                assert x["momentum"] == x["ns"], (name, x)  # the momentum of its own matrices only
                assert x["ns_calls"] == len(x["ns"]) * STEPS, (name, x)  # Newton-Schulz for them only
                load = sum(numel[m] for m in x["ns"])
                assert load <= muon_total / dp + max(numel[m] for m in r["routed"]), (name, x)
                # its momentum plus AdamW's two moments of its flat partition (ceil of each group / DP)
                assert x["state_numel"] <= load + 2 * sum(math.ceil(n / dp) for n in adam), (name, x)
                assert x["state_numel"] < (muon_total + 2 * sum(adam)) / dp * 4 / 3, (name, x)
        peers = {}
        for x in r["ranks"]:  # TP peers own the same matrices (they gather them together)
            peers.setdefault(x["dp_rank"], set()).add(tuple(x["ns"]))
        assert all(len(v) == 1 for v in peers.values()), peers
    # the same weights and micro-batches at step 1: the loss is the mean of the same 4 fp32 micro-batch losses,
    # summed exactly in float64 either way
    assert out["dp4"]["losses"][0] == out["dp1"]["losses"][0]
    # after that the runs differ in the order of the gradient sum of 4 micro-batches (relative error <= 3 * 2^-24);
    # Newton-Schulz rounds its input to bf16, so such a difference can move an orthogonalized entry (|O| <= 1.2,
    # the quintic's largest singular value) by a bf16 rounding (2^-8 relative): per step a weight moves by at most
    # muon.lr * AdjustLR (here <= 2, fc1's sqrt(128 / 32)) * 1.2 * 2^-8 more; AdamW's elementwise step stays at fp32
    one, four = torch.load(tmp_path / "dp1.json.pt"), torch.load(tmp_path / "dp4.json.pt")
    tol = STEPS * 0.02 * 2 * 1.2 * 2**-8
    worst = max(float((one[n] - four[n]).abs().max()) for n in one)
    assert worst <= tol, (worst, tol)

    # ---- checkpoints: pretraining entry point, ZeRO-1, fp32
    ckpt_args = [*common, "train.zero_stage=1", "train.precision=fp32", "train.save_interval=2"]

    def args(name: str, *extra: str) -> list[str]:
        return [*ckpt_args, f"train.save_dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'cache' / name}", *extra]

    def run(name: str, ranks: int, *extra: str) -> dict:
        if ranks == 1:
            status, log = _main(args(name, *extra), capsys)  # in this process
            assert status == 0, log[-3000:]
        return train_losses(tmp_path / name)

    def step2(name: str) -> str:
        return f"train.resume={tmp_path / name / 'step_00000002'}"

    saves = ["train.async_save=true", "train.ema.decay=0.9"]
    two_ranks = {  # one set of 2 rank processes, the runs in turn (each resume after another run: conftest)
        "two": args("two", *saves),
        "one_to_two": args("one_to_two", step2("dp1")),
        "two_again": args("two_again", *saves, step2("two")),
        "four_to_two": args("four_to_two", step2("dp4")),
    }
    for r in pretrain_group(list(two_ranks.values())):
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    two = run("two", 2)
    ckpt = tmp_path / "two" / "step_00000002"
    state = json.loads((ckpt / "megahash_state.json").read_text())
    # the momentum lives in optimizer/ (each tensor whole): DeepSpeed's ZeRO-0 files would hold rank 0's shard only
    assert state["deepspeed_files"] is False and not list(ckpt.glob("*model_states.pt"))
    assert json.loads((ckpt / "optimizer" / "megahash_optimizer.json").read_text())["complete"]
    again = run("two_again", 2)
    # bit-exact: resume is the promise (same layout, same machine)
    assert [again[s] for s in (3, 4)] == [two[s] for s in (3, 4)]
    for weights in ("live", "ema"):
        a, b = (
            _params(tmp_path / "two" / "step_00000004", weights),
            _params(tmp_path / "two_again" / "step_00000004", weights),
        )
        assert all(torch.equal(a[n], b[n]) for n in a), weights  # bit-exact: resume is the promise
    assert list((tmp_path / "dp1" / "step_00000002").glob("*model_states.pt"))  # one rank: not sharded
    straight = {name: dict(enumerate(out[name]["losses"], 1)) for name in ("dp1", "dp4")}
    resumed = {
        "2 -> 1": (run("two_to_one", 1, step2("two")), two),
        "1 -> 2": (run("one_to_two", 2), straight["dp1"]),
        "4 -> 2": (run("four_to_two", 2), straight["dp4"]),
    }
    fresh = run("two_to_one_fresh", 1, step2("two"), "train.resume_weights_only=true")
    # step 3: the saved weights and the same micro-batches (the loss a mean of fp32 values summed exactly)
    # step 4: after one step whose gradient sums the same 4 micro-batch gradients in another order: the loss
    # within 20 of its fp32 ulps (2^-21 in [4, 8)); losing the optimizer state moves it 2e-3 here
    tol = 20 * 2**-21
    for what, (got, before) in resumed.items():
        assert sorted(got) == [3, 4], what
        assert got[3] == before[3], (what, got, before)
        assert abs(got[4] - before[4]) <= tol, (what, got[4], before[4])
    assert abs(fresh[4] - two[4]) > 50 * tol, (fresh, two)


@pytest.mark.slow
def test_elastic_resume_carries_the_momentum(shakespeare_shards, tmp_path, dist):
    """2 data-parallel ranks (ZeRO-0) stop at step 2; one rank resumes there (another layout, megahash's movable
    optimizer state): every Muon buffer and Adam moment it loads equals the 2-rank run's own DeepSpeed file."""
    from megahash.config import load_config
    from megahash.training import checkpoint
    from megahash.training.profiling import TrainHarness

    common = [
        *_data(shakespeare_shards),
        *TINY,
        "train.zero_stage=0",
        "train.precision=fp32",
        "train.steps=3",
        f"train.save_dir={tmp_path}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    (r,) = pretrain_group([[*common, "train.stop_after=2"]])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp_path / "step_00000002"
    cfg = load_config(None, common)
    h = TrainHarness(cfg, 1)
    checkpoint.load(h.engine, ckpt, cfg)  # the elastic path: the layout changed (DP 2 -> 1)
    native = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["optimizer"]
    opt = h.engine.optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    saved = native["state"]
    assert len(saved) == len(params)
    muon = 0
    for i, p in enumerate(params):
        for key, value in saved[i].items():
            if torch.is_tensor(value) and value.ndim:
                assert torch.equal(opt.state[p][key], value), (i, key)  # bit-exact: the same floats copied
                muon += key == "momentum_buffer"
    assert muon == 2 * 5
    h.step()  # and it trains on


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensor_parallel_matrices_are_orthogonalized_whole(tmp_path):
    """parallel.tensor=2 (2 gloo processes, tests/training/muon_tp_worker.py): every routed matrix of the TP model, column-
    and row-parallel, gets its shard of NS(full matrix) bit for bit; NS of the shard alone differs."""
    out = tmp_path / "tp.json"
    _spawn("muon_tp_worker.py", 2, str(out), timeout=300)
    result = json.loads(out.read_text())
    assert len(result) == 5 and {r["dim"] for r in result.values()} == {0, 1}
    for name, r in result.items():
        # bit-exact: the gathered full matrix is the same tensor, NS the same operations on it (one path)
        assert r["full_shape"] and r["equal"], (name, r)
        assert r["alone_diff"] > 1e-2, (name, r)  # the shard alone is another matrix: another polar factor


# last in the file: the in-process pretraining tears down this module's one-rank world (the dist fixture)
@pytest.mark.parametrize(
    "levers",
    [[], LEVERS],
    ids=["plain", "warmup_polar_express"],
)
def test_bf16_stop_and_resume_is_bit_exact_and_logs_the_optimizer_phase(
    shakespeare_shards, tmp_path, capsys, ns_calls, levers
):
    """train.precision=bf16 (autocast over fp32 weights): 4 steps straight = 2 steps, stop, resume, 2 steps,
    bit for bit (the momentum buffers come back); the progress line carries optimizer_s. With the momentum
    warm-up (3 steps: the resume lands mid-warm-up) and Polar Express likewise."""
    from test_batch_ramp import _main, _records

    common = [
        *_data(shakespeare_shards),
        *TINY,
        "train.precision=bf16",
        "train.zero_stage=0",
        "train.steps=4",
        "train.log_interval=1",
        *levers,
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    status, out = _main([*common, f"train.save_dir={straight}"], capsys)
    assert status == 0 and "torch.bfloat16" in out, out[-3000:]
    assert len(ns_calls) == 4 * 2 * 5  # every step, every routed matrix
    assert re.search(r"\[train\] step 4/4 .*optimizer_s \d", out), out[-2000:]
    status, out = _main([*common, f"train.save_dir={split}", "train.stop_after=2"], capsys)
    assert status == 0 and "stopped at step 2" in out, out[-3000:]
    status, out = _main([*common, f"train.save_dir={split}"], capsys)
    assert status == 0 and f"resumed from {split}/step_00000002" in out, out[-3000:]
    a, b = _records(straight), _records(split)
    # bit-exact: resume is the promise (same configuration in process, same machine)
    assert [[a[s][k] for k in ("loss", "grad_norm")] for s in a] == [
        [b[s][k] for k in ("loss", "grad_norm")] for s in b
    ]
    assert a[4]["optimizer_s"] > 0
    # AdamW cannot take Muon's state: one line naming the fix (the layout records train.optimizer)
    status, out = _main([*common, f"train.save_dir={split}", "train.optimizer=adamw", "train.steps=5"], capsys)
    assert status == 2 and "train.resume_weights_only=true" in out, out[-3000:]


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_normuon_step_is_the_papers_formula_in_fp64(adjust):
    """train.muon.normuon (NorMuon, arXiv:2510.05491 Algorithm 1, the authors' normuon.py): two steps on a tall
    and a wide matrix from the same gradients as plain Muon. Plain Muon's step gives the orthogonalized update
    O_t = (W_{t-1} (1 - lr wd) - W_t) / AdjustLR; NorMuon's must be, in fp64, v_t = b2 v_{t-1} + (1 - b2)
    mean_j O_t[i, j]^2 per row, N = O_t / (sqrt(v_t) + 1e-10), the update N |O_t|_F / |N|_F, its state v_t [rows, 1]."""
    from torch.optim._muon import _adjust_lr

    from megahash.config import load_config
    from megahash.training.muon import ROW_MOMENT, MuonAdamW, group_settings

    lr, wd, b2 = 0.02, 0.1, 0.9
    keys = [f"train.muon.adjust_lr={adjust}", f"train.muon.normuon_beta2={b2}"]
    plain_cfg, nor_cfg = (
        load_config(None, ["train.optimizer=muon", *keys, *extra]).train.muon
        for extra in ([], ["train.muon.normuon=true"])
    )
    gen = torch.Generator().manual_seed(0)
    shapes = [(48, 16), (16, 40)]
    w0 = [torch.randn(s, generator=gen) for s in shapes]

    def optimizer(m):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        group = {"params": params, "use_muon": True, "lr": lr, "weight_decay": wd, **group_settings(m, 0)}
        return params, MuonAdamW([group], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    (plain, opt_p), (nor, opt_n) = optimizer(plain_cfg), optimizer(nor_cfg)
    v = [torch.zeros(s[0], 1, dtype=torch.float64) for s in shapes]
    for _ in range(2):
        before_p = [p.detach().double().clone() for p in plain]
        before_n = [p.detach().double().clone() for p in nor]
        for a, b in zip(plain, nor):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt_p.step()
        opt_n.step()
        for i, (a, b) in enumerate(zip(plain, nor)):
            scale = _adjust_lr(lr, adjust, a.shape)
            o = (before_p[i] * (1 - lr * wd) - a.detach().double()) / scale
            v[i] = b2 * v[i] + (1 - b2) * o.square().mean(dim=1, keepdim=True)
            n = o / (v[i].sqrt() + 1e-10)
            want = before_n[i] * (1 - lr * wd) - scale * n * (o.norm() / n.norm())
            # fp32 weights of unit scale; O recovered from fp32 weights: ~1e-7 / (lr x AdjustLR) relative
            assert torch.allclose(b.detach().double(), want, rtol=0, atol=2e-6), (i, (b.double() - want).abs().max())
            assert opt_n.state[b][ROW_MOMENT].shape == (a.shape[0], 1)
            assert torch.allclose(opt_n.state[b][ROW_MOMENT].double(), v[i], rtol=1e-4, atol=0)
    # the row normalisation changed the step (rows of O differ in scale)
    assert not torch.allclose(plain[0], nor[0], atol=1e-4)
    assert ROW_MOMENT not in opt_p.state[plain[0]]


NORMUON = ["train.muon.normuon=true", "train.muon.normuon_beta2=0.9"]


def test_normuon_stop_and_resume_is_bit_exact_its_row_moments_saved(shakespeare_shards, tmp_path, capsys):
    """One rank, NorMuon: 4 straight steps == 2, stop, resume for 2 (losses, gradient norms, weights bit for bit);
    the checkpoint's movable optimizer state holds each matrix's row moments (broadcast to its shape, every column
    the same) beside its momentum."""
    from test_batch_ramp import _main, _records

    common = [*_data(shakespeare_shards), *TINY, *NORMUON, "train.steps=4", "train.log_interval=1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for where, extra in ((straight, []), (split, ["train.stop_after=2"]), (split, [])):
        status, out = _main([*common, f"train.save_dir={where}", *extra], capsys)
        assert status == 0, out[-3000:]
    a, b = _records(straight), _records(split)
    keys = ("loss", "grad_norm", "param_norm")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [[a[s][k] for k in keys] for s in a] == [[b[s][k] for k in keys] for s in b]  # bit-exact: resume
    one, two = (
        torch.load(d / "step_00000004" / "mp_rank_00_model_states.pt", weights_only=False) for d in (straight, split)
    )
    # bit-exact: resume is the promise (same path, same machine)
    assert all(torch.equal(v, two["module"][k]) for k, v in one["module"].items() if torch.is_tensor(v))
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(split / "step_00000002" / "optimizer"))
    rows = [k for k in saved if k.startswith("second_momentum_buffer")]
    assert rows and len(rows) == len([k for k in saved if k.startswith("momentum_buffer")]), sorted(saved)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sharded_normuon_steps_as_one_rank_and_resumes(shakespeare_shards, tmp_path, capsys):
    """NorMuon sharded over 2 data-parallel ranks (ZeRO-1): every step equals single-rank NorMuon stepped beside it
    on the same gradients bit for bit (tests/training/muon_dp_worker.py), each rank holding the row moments of its
    own matrices only; 2 ranks resumed from step 2 log steps 3-4 as the straight run, bit for bit (the row moments
    gathered from their owners into the checkpoint and handed back to them); one rank resumed there takes step 3
    bit for bit and step 4 within the reduction order of one step's gradients."""
    from test_batch_ramp import _main

    from megahash.training.muon import ROW_MOMENT

    common = [
        *_data(shakespeare_shards),
        *TINY,
        *NORMUON,
        "train.micro_batch_size=1",
        "train.global_batch_size=4",
        f"train.steps={STEPS}",
        "train.log_interval=1",
        "train.zero_stage=1",
    ]
    path = tmp_path / "dp2.json"
    where = [f"train.save_dir={tmp_path / 'dp2'}", f"data.cache_dir={tmp_path / 'cache' / 'dp2'}"]
    _spawn("muon_dp_worker.py", 2, str(path), "1", str(STEPS), "0", *common, *where)
    r = json.loads(path.read_text())
    assert r["sharded"] and r["diffs"] == [0.0] * STEPS, r["diffs"]  # bit-exact: the owner runs the same ops
    assert sorted(m for x in r["ranks"] for m in x["ns"]) == r["routed"]

    def args(name: str, *extra: str) -> list[str]:
        return [*common, "train.save_interval=2", f"train.save_dir={tmp_path / name}", *extra]

    step2 = f"train.resume={tmp_path / 'two' / 'step_00000002'}"
    for res in pretrain_group([args("two"), args("two_again", step2)]):
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    status, out = _main(args("two_to_one", step2), capsys)
    assert status == 0, out[-3000:]
    two, again, one = (train_losses(tmp_path / n) for n in ("two", "two_again", "two_to_one"))
    assert [again[s] for s in (3, 4)] == [two[s] for s in (3, 4)]  # bit-exact: resume is the promise
    assert one[3] == two[3] and abs(one[4] - two[4]) <= 20 * 2**-21, (one, two)
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_tensors_metadata(str(tmp_path / "two" / "step_00000002" / "optimizer"))
    assert any(k.startswith(ROW_MOMENT) for k in saved), sorted(saved)


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["parallel.tensor=2"], "train.muon.normuon normalizes the whole rows of each matrix and is not implemented"),
        (["train.muon.normuon_beta2=1.0"], "train.muon.normuon_beta2"),
    ],
)
def test_normuon_bad_settings_are_one_line(extra, expect):
    from megahash.config import load_config
    from megahash.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.optimizer=muon", "train.muon.normuon=true", *extra])
    assert expect in str(e.value) and "\n" not in str(e.value)
