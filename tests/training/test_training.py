"""Training core on real text: TP/SP parity, exact resume, interrupted saves, one-line errors,
loss decreasing. The multi-rank runs (2 CPU gloo ranks with the DeepSpeed launcher's environment) are made
by the module fixture ``two_ranks`` in one set of rank processes (conftest.pretrain_group, one start-up): the
first runs and the runs a resume continues, then the resumes, whose processes have run other configurations
before (a resume that restored less than it must would pick up their state, not the step it stopped at). One-rank
runs are in this process (conftest.pretrain_here) unless a fresh process's output is what is checked."""

import json
import re
import sys

import pytest

from conftest import TINIER, TINY, pretrain, pretrain_group, pretrain_here, run, train_losses


def base(shards, save_dir, steps, *extra):
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"train.steps={steps}",
        f"train.save_dir={save_dir}",
        *extra,
    ]


PARITY = {
    "tp2": ["parallel.tensor=2"],
    "tp2sp": ["parallel.tensor=2", "parallel.sequence=true"],
    "dp2_zero3": ["train.zero_stage=3"],
}
RESUME = ["train.eval_interval=5", "train.zero_stage=1"]
HYBRID = [
    "train.eval_interval=0",
    "model.num_layers=4",
    "model.schedule=list:mha,rndembqk,mhe-mul,mqa",
    "parallel.tensor=2",
]
BF16 = [
    "train.precision=bf16",
    "train.zero_stage=1",
    "train.eval_interval=0",
    "train.save_interval=2",
    "train.keep_last=0",
]


def _quickstart(shards, run_dir):
    return [
        "--config",
        "configs/quickstart.yaml",
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        "train.steps=60",
        f"train.save_dir={run_dir}",
        "train.eval_interval=20",
        "train.save_interval=0",
        "data.seq_length=64",
        "train.micro_batch_size=8",
    ]


@pytest.fixture(scope="module")
def two_ranks(shakespeare_shards, tmp_path_factory):
    """name -> (CompletedProcess, run dir) of every 2-rank run of this module, and the facts a test checks
    between a stop and its resume (``between``)."""
    sh, d = shakespeare_shards, tmp_path_factory.mktemp("two_ranks")
    first = {f"parity_{n}": base(sh, d / n, 6, "train.eval_interval=0", *extra) for n, extra in PARITY.items()}
    first |= {
        "resume_split": base(sh, d / "split", 10, *RESUME, "train.stop_after=5"),
        "resume_straight": base(sh, d / "straight", 10, *RESUME),
        "hybrid_split": base(sh, d / "hsplit", 6, *HYBRID, "train.stop_after=3"),
        "hybrid_straight": base(sh, d / "hstraight", 6, *HYBRID),
        "bf16_two": base(sh, d / "two", 4, *BF16),
        "quickstart": _quickstart(sh, d / "qs"),
    }
    then = {
        "resume_resumed": base(sh, d / "split", 10, *RESUME),
        "hybrid_resumed": base(sh, d / "hsplit", 6, *HYBRID),
        "bf16_resumed": base(sh, d / "resumed", 4, *BF16, f"train.resume={d / 'two' / 'step_00000002'}"),
    }
    runs = first | then  # in this order: every resume after the run it continues, in the same processes
    return {"dir": d, **dict(zip(runs, pretrain_group(list(runs.values()), timeout=1800)))}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp_and_sp_parity(shakespeare_shards, two_ranks, tmp_path):
    """TP=1, TP=2, TP=2+SP and 2 data-parallel ranks under ZeRO-3 give the same per-step losses
    (dropout 0, fp32) to 1e-4."""
    d = two_ranks["dir"]
    dirs = {"tp1": tmp_path / "tp1", **{name: d / name for name in PARITY}}
    losses = {}
    for name in dirs:
        if name == "tp1":
            r = pretrain_here(base(shakespeare_shards, dirs[name], 6, "train.eval_interval=0"))
        else:
            r = two_ranks[f"parity_{name}"]
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        for noise in ("CUDA_DEVICE_MAX_CONNECTIONS", "reduce_scatter_tensor` is deprecated"):  # issue 29
            assert noise not in r.stderr, (name, r.stderr[-3000:])
        losses[name] = train_losses(dirs[name])
    assert len(losses["tp1"]) == 6
    for name in ("tp2", "tp2sp", "dp2_zero3"):
        for step, loss in losses["tp1"].items():
            assert abs(losses[name][step] - loss) < 1e-4, (name, step, loss, losses[name][step])
    assert losses["tp1"][6] < losses["tp1"][1]
    # the weights of every layout load into one TP=1 model and agree (megatron dist checkpoint)
    script = (
        "import sys, torch\n"
        "from megahash.accelerator import process_groups\n"
        "from megahash.checkpoint.weights import load_for_inference\n"
        "ref = None\n"
        "for d in sys.argv[1:]:\n"
        "    _, m, _ = load_for_inference(d)\n"
        "    sd = {k: v.clone() for k, v in m.state_dict().items() if torch.is_tensor(v) and torch.is_floating_point(v)}\n"
        "    ref = ref or sd\n"
        "    print(max((sd[k] - ref[k]).abs().max().item() for k in ref))\n"
        "    process_groups.teardown()\n"
    )
    r = run([sys.executable, "-c", script, *(str(p) for p in dirs.values())])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ShardedTensor" not in r.stderr and "load_state_dict` is deprecated" not in r.stderr, r.stderr[-3000:]
    diffs = [float(x) for x in r.stdout.split()]
    assert len(diffs) == 4 and max(diffs) < 1e-5, diffs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_reproduces_uninterrupted_run(two_ranks):
    """10 straight steps == 5 steps, stop, resume for 5 (2 data-parallel ranks, ZeRO-1; validation at 5 and 10)."""
    straight, split = two_ranks["dir"] / "straight", two_ranks["dir"] / "split"
    r = two_ranks["resume_straight"]
    assert r.returncode == 0, r.stderr[-3000:]
    r = two_ranks["resume_split"]
    assert r.returncode == 0, r.stderr[-3000:]
    # the stop: at step 5, its checkpoint named by latest (what the resume reads), no step 10 (below: the
    # step-10 checkpoint has the resume's config, stop_after 0)
    assert "megahash: stopped at step 5 (train.stop_after=5)" in r.stdout, r.stdout[-3000:]
    r = two_ranks["resume_resumed"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {split}/step_00000005" in r.stdout, r.stdout[-3000:]
    a, b = train_losses(straight), train_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    # bit-exact: resume is the promise (same ranks, threads and kernels on this machine)
    assert [a[s] for s in range(1, 11)] == [b[s] for s in range(1, 11)]  # bit-identical
    valid = train_losses(straight, "valid")
    assert sorted(valid) == [5, 10] and valid == train_losses(split, "valid")
    cfg = (split / "step_00000010" / "resolved_config.yaml").read_text()
    assert "stop_after: 0" in cfg and f"save_dir: {split}" in cfg


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hybrid_schedule_checkpoints_resume_and_load_at_tp1(two_ranks):
    """A schedule whose layers differ in parameters (RndEmbQK layers have no linear_qkv) saves at
    TP=2 (one key per layer in the dist checkpoint), resumes bit-exactly and loads at TP=1."""
    straight, split = two_ranks["dir"] / "hstraight", two_ranks["dir"] / "hsplit"
    r = two_ranks["hybrid_straight"]
    assert r.returncode == 0, r.stderr[-3000:]
    r = two_ranks["hybrid_split"]
    assert r.returncode == 0, r.stderr[-3000:]
    r = two_ranks["hybrid_resumed"]
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    a, b = train_losses(straight), train_losses(split)
    # bit-exact: resume is the promise (same ranks and layout, same machine)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    script = (
        "import sys\n"
        "from megahash.checkpoint.weights import load_for_inference\n"
        "_, m, _ = load_for_inference(sys.argv[1])\n"
        "print(sorted(type(l.self_attention).__name__ for l in m.decoder.layers))\n"
    )
    r = run([sys.executable, "-c", script, str(straight)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(set(eval(r.stdout.strip().splitlines()[-1]))) >= 3
    # a model with fewer layers is refused with the layers it does not have, not loaded partially
    script = (
        "import sys\n"
        "from megahash.checkpoint.weights import load_for_inference\n"
        "load_for_inference(sys.argv[1], ['model.num_layers=3', 'model.schedule=list:mha,rndembqk,mhe-mul'])\n"
    )
    r = run([sys.executable, "-c", script, str(straight)])
    assert r.returncode != 0 and "the model has no ['decoder.layers.3." in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bf16_on_two_data_parallel_ranks_matches_one_rank_and_resumes_exactly(shakespeare_shards, two_ranks, tmp_path):
    """train.precision=bf16 (fp32 parameters, bf16 compute under autocast) on 2 gloo ranks, ZeRO-1
    (optimizer state partitioned over the ranks): per-step losses equal the 1-rank run of the same
    global batch within bf16 tolerance, and a run resumed from the step-2 checkpoint logs steps 3-4
    bit for bit as the uninterrupted one (issue 25 item 2)."""
    one, two, resumed = tmp_path / "one", two_ranks["dir"] / "two", two_ranks["dir"] / "resumed"
    r = pretrain_here(base(shakespeare_shards, one, 4, *BF16))
    assert r.returncode == 0 and "torch.bfloat16" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    r = two_ranks["bf16_two"]
    assert r.returncode == 0 and "dp 2), torch.bfloat16, ZeRO-1" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    r = two_ranks["bf16_resumed"]
    assert r.returncode == 0 and f"resumed from {two}/step_00000002" in r.stdout, r.stderr[-3000:]
    a, b, c = train_losses(one), train_losses(two), train_losses(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and sorted(c) == [3, 4], (a, b, c)
    assert abs(a[1] - b[1]) < 1e-3, (a, b)  # same weights, same micro-batches: only the averaging differs
    for step in (2, 3, 4):  # then bf16 gradients reduced over 2 ranks instead of accumulated on one
        assert abs(a[step] - b[step]) < 2e-2, (step, a, b)
    assert a[4] < a[1] and b[4] < b[1]
    # bit-exact: resume is the promise (2 ranks both, same machine); 1 vs 2 ranks above: tolerances
    assert [b[3], b[4]] == [c[3], c[4]]  # bit-identical
    state = json.loads((two / "step_00000002" / "megahash_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2


def test_interrupted_save_keeps_previous_checkpoint(shakespeare_shards, tmp_path):
    run_dir = tmp_path / "run"
    args = base(shakespeare_shards, run_dir, 8, "train.save_interval=4", "train.eval_interval=0")
    r = pretrain_here(args, MEGAHASH_TEST_FAIL_IN_SAVE="8")
    assert r.returncode != 0 and "injected failure" in r.stderr
    assert (run_dir / "latest").read_text() == "step_00000004"
    assert not (run_dir / "step_00000008").exists()  # only the .tmp, never under the final name
    r = pretrain_here(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run_dir}/step_00000004" in r.stdout
    assert (run_dir / "latest").read_text() == "step_00000008"


def test_checkpoint_of_the_previous_release_still_resumes(shakespeare_shards, tmp_path, capsys):
    """A checkpoint as the release before megatron-core's OptimizerParamScheduler wrote it (DeepSpeed's
    ``lr_scheduler`` entry a torch ``LambdaLR`` state, ``train.eval_iters`` in its resolved config, and the
    training features' keys flat in ``train`` as before issue 46: ``train.ema_decay``, ``train.max_skips``, ...)
    resumes in process and continues the uninterrupted run: losses and LRs bit for bit; evaluation and export
    read its config (the retired key dropped, the old keys under their new names)."""
    import torch
    import yaml
    from test_batch_ramp import _main, _records

    from megahash.checkpoint.manifest import write_manifest
    from megahash.config import load_config
    from megahash.training.lr_schedule import lambda_for

    common = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINIER,
        "train.lr=2e-3",
        "train.min_lr=2e-4",
        "train.warmup_steps=2",
        "train.decay=wsd",
        "train.decay_fraction=0.5",
        "train.steps=6",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for extra in ([f"train.save_dir={straight}"], [f"train.save_dir={split}", "train.stop_after=3"]):
        status, out = _main([*common, *extra], capsys)
        assert status == 0, out[-3000:]
    ckpt = split / "step_00000003"
    t = load_config(None, common).train
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]} for _ in range(2)]  # AdamW's decay, no decay
    opt = torch.optim.SGD(groups, lr=t.lr)
    old = torch.optim.lr_scheduler.LambdaLR(opt, lambda_for(t))  # the scheduler that release built
    for _ in range(3):
        opt.step()
        old.step()
    ds = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    ds["lr_scheduler"] = old.state_dict()
    torch.save(ds, ckpt / "mp_rank_00_model_states.pt")
    tree = yaml.safe_load((ckpt / "resolved_config.yaml").read_text())
    tree["train"]["eval_iters"] = 4
    from megahash.config import RENAMED_KEYS

    for old, new in RENAMED_KEYS.items():  # that release's spelling: every feature key flat in train
        tree[old[0]][old[1]] = tree[new[0]][new[1]].pop(new[2])
    for section in {new[1] for new in RENAMED_KEYS.values()}:
        tree["train"].pop(section)  # that release had no such section (keys added since: their defaults)
    (ckpt / "resolved_config.yaml").write_text(yaml.safe_dump(tree))
    write_manifest(ckpt, hashes=False)  # sizes only, as that release's manifest recorded them
    status, out = _main([*common, f"train.save_dir={split}"], capsys)
    assert status == 0 and f"resumed from {ckpt}" in out, out[-3000:]
    a, b = _records(straight), _records(split)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # bit-exact: resume is the promise (same configuration in process, same machine)
    assert [(a[s]["loss"], a[s]["lr"]) for s in a] == [(b[s]["loss"], b[s]["lr"]) for s in b]
    from megahash.checkpoint.resolve import checkpoint_config

    assert checkpoint_config(ckpt).model == load_config(None, common).model  # what eval and export-hf read
    assert checkpoint_config(ckpt).train.step_guard == load_config(None, common).train.step_guard


def test_checkpoint_from_another_model_is_refused(shakespeare_shards, tmp_path):
    """... and a run prints megahash's lines only (issue 36: DeepSpeed's "Setting accelerator to CPU" and
    "shm_comm_op built successfully", megatron-core's fallback warnings, progress bars are dropped);
    --verbose shows the libraries' lines again."""
    run_dir = tmp_path / "run"
    r = pretrain(base(shakespeare_shards, run_dir, 2, "train.eval_interval=0"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (r.stdout + r.stderr).splitlines()
    assert lines and all(re.match(r"megahash: |\[train\] ", line) for line in lines), lines
    r = pretrain(["--verbose", *base(shakespeare_shards, run_dir, 4, "train.eval_interval=0", "model.hidden_size=128")])
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("error: checkpoint") and "model.hidden_size" in err[-1]
    assert "Transformer Engine and Apex are not installed" in r.stderr  # megatron-core's, shown with --verbose


def test_checkpoint_of_another_tokenizer_is_refused_and_its_own_vocabulary_spelled_out_resumes(
    shakespeare_shards, tmp_path
):
    """``model.vocab_size=0`` takes the tokenizer's vocabulary, so the saved model tree says 0 whatever the
    tokenizer: a resume on shards of another tokenizer (600 ids, not 1,000) was taken for damage, fell back to an
    older checkpoint, loaded it into the other embedding and wrote on. It is refused in one line naming the
    vocabulary, exit 2, the run folder as it was; the checkpoint's own vocabulary given explicitly
    (``model.vocab_size=1000``, the same embedding rows) resumes."""
    other = tmp_path / "other"
    tools = [sys.executable, "data_tools/train_tokenizer.py", "--input", "shakespeare", "--max-docs", "50"]
    assert run([*tools, "--output", str(other / "spm"), "--vocab-size", "600", "--quiet"]).returncode == 0
    r = run(
        [sys.executable, "data_tools/preprocess_data.py", "--input", "shakespeare", "--max-docs", "100", "--quiet"]
        + ["--output-prefix", str(other / "sh"), "--tokenizer", str(other / "spm.model"), "--workers", "1"]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    run_dir = tmp_path / "run"
    extra = ("train.eval_interval=0", "train.save_interval=1", "train.keep_last=0")
    assert pretrain_here(base(shakespeare_shards, run_dir, 2, *extra)).returncode == 0

    def listing():
        return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))

    before = listing()
    shards = {"prefix": str(other / "sh"), "tokenizer": str(other / "spm.model")}
    r = pretrain_here(base(shards, run_dir, 4, *extra))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert "vocabulary: checkpoint 1024 embedding rows vs 640" in errors[0] and "data.tokenizer" in errors[0]
    assert listing() == before
    r = pretrain_here(base(shakespeare_shards, run_dir, 3, *extra, "model.vocab_size=1000"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and sorted(train_losses(run_dir)) == [1, 2, 3]


@pytest.mark.parametrize(
    "override, expect",
    [
        ("data.prefix=[/nonexistent/corpus]", "does not exist"),
        ("parallel.tensor=3", "does not divide model.num_heads"),
        ("data.seq_length=100000", "exceeds model.max_position_embeddings"),
        ("train.lerning_rate=1", "unknown config key"),
    ],
)
def test_entry_point_one_line_errors(shakespeare_shards, tmp_path, override, expect):
    r = pretrain(base(shakespeare_shards, tmp_path / "x", 2) + [override])
    assert r.returncode == 2
    lines = [l for l in r.stderr.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and expect in lines[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_before_the_run(shakespeare_shards, tmp_path):
    """model.vocab_size=500 under a tokenizer of 1,000 ids started training and stopped at the first sample
    holding an id >= 500, calling the shard damaged, with the run folder begun; now one line before it."""
    run_dir = tmp_path / "x"
    r = pretrain_here(base(shakespeare_shards, run_dir, 2, "model.vocab_size=500"))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert errors[0].startswith("error: model.vocab_size=500 is smaller than the tokenizer's 1000 ids"), errors
    assert "model.vocab_size=0" in errors[0] and not run_dir.exists()


def test_tp_must_divide_world_size(shakespeare_shards, tmp_path):
    r = pretrain_here(base(shakespeare_shards, tmp_path / "x", 2, "parallel.tensor=2"))
    assert r.returncode == 2 and "does not divide the world size 1" in r.stderr


@pytest.mark.multiprocess
def test_loss_decreases_on_real_text(two_ranks):
    """Quickstart recipe (shortened): validation loss falls well below its start and a PNG is written."""
    run_dir = two_ranks["dir"] / "qs"
    r = two_ranks["quickstart"]
    assert r.returncode == 0, r.stderr[-3000:]
    valid = train_losses(run_dir, "valid")
    assert valid[60] < valid[20] - 0.15, valid  # measured drops 0.25-0.39 over seeds
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    assert json.loads((run_dir / "step_00000060" / "megahash_state.json").read_text())["step"] == 60


def test_a_run_saves_the_precision_it_computes_in():
    """train.precision=auto is resolved on the run's device before resolved_config.yaml is written. Before, the
    file said auto: a CPU run's file, fed back as --config on a GPU, trained in bf16, not the fp32 it recorded."""
    from megahash.accelerator import policy
    from megahash.config import load_config
    from megahash.training.trainer import resolve_precision

    for dev, want in (("cpu", "fp32"), ("cuda", "bf16")):
        cfg = load_config("configs/quickstart.yaml")
        assert cfg.train.precision == "auto"
        resolve_precision(cfg, dev)
        assert cfg.train.precision == want
        for elsewhere in ("cpu", "cuda"):  # the saved value computes in the run's dtype on any device
            assert policy.train_dtype(want, elsewhere) == policy.train_dtype("auto", dev)
    cfg = load_config("configs/quickstart.yaml", ["train.precision=bf16"])
    resolve_precision(cfg, "cpu")
    assert cfg.train.precision == "bf16"  # an explicit one is kept
