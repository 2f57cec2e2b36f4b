"""train.optimizer=muon (megahash/training/muon.py): one step equals torch.optim.Muon on the hidden matrices +
torch.optim.AdamW on the rest; Newton-Schulz runs on every routed matrix through the real DeepSpeed engine at
every ZeRO stage megahash runs it at (the partitioning ones refused in one line); stop + resume is bit-exact
under bf16 and the optimizer phase's time is in the progress line; the momentum follows an elastic resume."""

import json
import re

import pytest
import torch

from conftest import pretrain

pytestmark = pytest.mark.numerics  # compares floating-point results (see tests/numerics.py)

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.ffn_hidden_size=64",
    "model.vocab_size=0",
    "data.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.lr=2e-3",
    "train.warmup_steps=1",
    "train.eval_interval=0",
    "train.keep_last=0",
    "logging.plot=false",
    "logging.tensorboard=false",
    "train.optimizer=muon",
    "train.muon_lr=0.02",
]
# the attention and MLP projections of megatron-core's layers, by name (independent of muon.routes_to_muon)
HIDDEN = re.compile(r"decoder\.layers\.\d+\.(self_attention\.linear_(q|kv|qkv|proj)|mlp\.linear_fc[12])\.weight")


def _data(shards) -> list[str]:
    return [f"data.prefix=[{shards['prefix']}]", f"data.tokenizer={shards['tokenizer']}"]


@pytest.fixture
def ns_calls(monkeypatch):
    """Shapes of the matrices Newton-Schulz ran on (megahash.training.muon.newton_schulz wrapped)."""
    from megahash.training import muon

    calls, real = [], muon.newton_schulz

    def counted(update, *args):
        calls.append(tuple(update.shape))
        return real(update, *args)

    monkeypatch.setattr(muon, "newton_schulz", counted)
    return calls


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_two_steps_equal_torch_muon_plus_adamw(dist, adjust):
    """From the same weights and gradients: the routed matrices step as torch.optim.Muon, the rest as
    torch.optim.AdamW (decay on 2-D, none on 1-D); two steps, so the momentum buffer carries."""
    from megahash import accelerator
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model
    from megahash.training.muon import build_optimizer, routes_to_muon
    from megahash.training.trainer import param_groups

    cfg = load_config(None, [*TINY, "model.vocab_size=100", "train.weight_decay=0.1", f"train.muon_adjust_lr={adjust}"])
    t = cfg.train
    accelerator.seed_all(t.seed)
    ours = build_model(cfg, 100)
    ref = build_model(cfg, 100)
    ref.load_state_dict(ours.state_dict())
    route = routes_to_muon(ours)
    assert {n for n, r in route.items() if r} == {n for n, _ in ours.named_parameters() if HIDDEN.fullmatch(n)}
    assert not any(route[n] for n in route if "embedding" in n or "layernorm" in n or n.endswith("bias"))
    opt = build_optimizer(ours, t, param_groups(ours, t.weight_decay), {})
    named = dict(ref.named_parameters())
    hidden = [p for n, p in named.items() if route[n]]
    rest = [p for n, p in named.items() if not route[n]]
    ref_muon = torch.optim.Muon(
        hidden,
        lr=t.muon_lr,
        weight_decay=t.weight_decay,
        momentum=t.muon_momentum,
        nesterov=t.muon_nesterov,
        ns_steps=t.muon_ns_steps,
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


def test_partitioning_stages_are_refused_in_one_line(shakespeare_shards):
    """ZeRO-3 at config time; ZeRO-1/2 once the data-parallel size makes them partition."""
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.training.ds_config import deepspeed_config

    with pytest.raises(ConfigError, match=r"ZeRO stage 3 .* set train.zero_stage=0"):
        load_config(None, [*TINY, "train.zero_stage=3"])
    for stage in (1, 2):
        cfg = load_config(None, [*TINY, f"train.zero_stage={stage}"])
        with pytest.raises(ConfigError, match=rf"ZeRO stage {stage} partitions .* set train.zero_stage=0") as e:
            deepspeed_config(cfg, dp_size=2, bf16=False)
        assert "\n" not in str(e.value)
        assert deepspeed_config(cfg, dp_size=1, bf16=False)["zero_optimization"]["stage"] == 0
    with pytest.raises(ConfigError, match="needs fp32 parameters"):
        deepspeed_config(load_config(None, [*TINY, "train.zero_stage=0"]), dp_size=1, bf16=True)


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
    r = pretrain([*common, "train.stop_after=2"], ranks=2)
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
    import os
    import subprocess
    import sys

    from megahash.launching.env import free_port

    out = tmp_path / "tp.json"
    worker = os.path.join(os.path.dirname(__file__), "muon_tp_worker.py")
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, worker, str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    result = json.loads(out.read_text())
    assert len(result) == 5 and {r["dim"] for r in result.values()} == {0, 1}
    for name, r in result.items():
        # bit-exact: the gathered full matrix is the same tensor, NS the same operations on it (one path)
        assert r["full_shape"] and r["equal"], (name, r)
        assert r["alone_diff"] > 1e-2, (name, r)  # the shard alone is another matrix: another polar factor


# last in the file: the in-process pretraining tears down this module's one-rank world (the dist fixture)
def test_bf16_stop_and_resume_is_bit_exact_and_logs_the_optimizer_phase(shakespeare_shards, tmp_path, capsys, ns_calls):
    """train.precision=bf16 (autocast over fp32 weights): 4 steps straight = 2 steps, stop, resume, 2 steps,
    bit for bit (the momentum buffers come back); the progress line carries optimizer_s."""
    from test_batch_ramp import _main, _records

    common = [
        *_data(shakespeare_shards),
        *TINY,
        "train.precision=bf16",
        "train.zero_stage=0",
        "train.steps=4",
        "train.log_interval=1",
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
