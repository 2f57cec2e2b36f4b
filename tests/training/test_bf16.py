"""bf16 end to end (issue 33): ``train.precision=bf16`` (fp32 parameters, compute under autocast: the
path ``auto`` takes on CUDA, ``megahash.accelerator`` decides) trains through validation, saves,
resumes exactly and at another layout, evaluates, decodes and exports, for every attention kind,
embedding kind, head and objective the registry offers (tests/_kinds.py), on CPU.

In this process with the tiniest model where the subprocess is not the point: one 4-step run per
configuration (validation at steps 2 and 4, a checkpoint at step 2) and a run resumed from step 2 that
logs steps 3-4 and the step-4 validation bit for bit. Every attention kind rides in a ``list:``
schedule of a few models (one fixed input per model), so the whole matrix is a dozen configurations. One
real ``pretrain.py`` launch (a ``megahash sweep`` cell, with its ``megahash eval``) covers the subprocess
path; stop, resume at another ZeRO stage and ``megahash export-hf`` follow it here. The ``gpu`` twin runs the
same matrix on CUDA."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import _kinds
import pytest
import torch

from conftest import TINIER, megahash_here, pretrain_here, run

TINY = [
    *TINIER,
    "model.num_layers=2",
    "model.attention.options.fixed_seq_length=16",
    "data.seq_length=16",
    "data.valid_samples=4",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.lr=2e-3",
    "train.warmup_steps=2",
    "train.steps=4",
    "train.eval_interval=2",
    "train.save_interval=2",
    "train.zero_stage=1",
]
BF16 = ["train.precision=bf16", "train.zero_stage=1"]
FASTER = {"pool": ["model.embed.options.pool_bits=6"], "rolling": ["model.embed.options.rolling_dim=24"]}
COMPARED = ("loss", "grad_norm", "param_norm", "lr", "consumed_samples")


def kind_groups() -> list[list[str]]:
    """Every registered attention kind (each with its examples' per-layer options, ``_kinds.variants``) in a few
    ``list:`` schedules: the kinds that decode and export (with the first fixed-input kind: one fixed input per
    model), each further fixed-input kind beside the standard kind, then the kinds that neither decode nor export."""
    standard = _kinds.attention(standard=True)[0]
    fixed = _kinds.attention(fixed_input=True)
    full = [k for k in _kinds.variants(decoder=True, decodes=True, exportable=True) if k not in fixed]
    rest = [k for k in _kinds.variants(decoder=True) if k not in fixed and k not in full]
    groups = [full + fixed[:1]] + [[k, standard] for k in fixed[1:]]
    return groups + ([rest] if rest else [])


KIND_GROUPS = {
    ("kinds-" + "+".join(g) if len(g) < 4 else f"kinds-{len(g)}-{g[0]}-to-{g[-1]}"): g for g in kind_groups()
}


def _embedding(kind: str) -> list[str]:
    from megahash import catalog

    return [
        f"model.embedding={kind}",
        f"model.embed.hash_spec={catalog.caps('embedding', kind).example_hash_spec}",
        *FASTER.get(kind, []),
    ]


def configurations() -> dict[str, list[str]]:
    """name -> overrides: the kind groups (decoders, clm), every non-standard embedding kind, every
    selectable non-standard head, every corruption objective in an encoder (the first over every kind
    an encoder runs but the further fixed-input kinds, the others over those)."""
    from megahash.objective_spec import names, objective_spec

    out = {}
    for name, kinds in KIND_GROUPS.items():
        out[name] = [f"model.num_layers={len(kinds)}", "model.schedule=list:" + ",".join(kinds)]
    for emb in _kinds.embeddings(standard=False):
        out[f"embedding-{emb}"] = ["model.num_layers=2", *_embedding(emb)]
    for head in _kinds.heads(selectable=True, standard=False):
        out[f"head-{head}"] = ["model.num_layers=2", f"model.head={head}"]
    fixed = _kinds.attention(fixed_input=True)
    encoder_kinds = [k for k in _kinds.variants(encoder=True) if k not in fixed[1:]]
    for i, obj in enumerate(n for n in names() if objective_spec(n).corrupt is not None):
        kinds = encoder_kinds if i == 0 else fixed[1:] + _kinds.attention(standard=True)[:1]
        out[f"objective-{obj}"] = [
            f"train.objective={obj}",
            "model.arch=encoder",
            f"model.num_layers={len(kinds)}",
            "model.schedule=list:" + ",".join(kinds),
        ]
    out["levers"] = [  # issue 44's levers together, on hash embeddings and MHE (docs/compact_models.md#levers)
        "model.num_layers=2",
        "model.schedule=list:mhe-mul,mha",
        *_embedding("hash-emb"),
        "model.qk_norm=true",
        "model.qkv_bias=false",
        "model.qk_gain=1.5",
        "model.logit_softcap=15",
        "model.mlp_activation=relu2",
        "model.zero_init_proj=true",
        "model.embed_init_std=0.005",
        "model.x0_mix=true",
        "model.unet_skips=true",
        "model.value_embeds=1",
        "train.embed_lr=0.01",
        "train.z_loss=1e-4",
        "train.optimizer=muon",
    ]
    return out


CONFIGS = configurations()


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """name -> the run directory of a configuration's 4-step bf16 run (made once, by the first test asking)."""
    return {"root": tmp_path_factory.mktemp("bf16_runs")}


@pytest.fixture
def one_rank():
    """A one-rank world for in-process models, per test: the pretraining runs of this module tear the
    process group down at their end (a module-wide ``dist`` fixture would not survive them)."""
    from megahash.accelerator import process_groups

    process_groups.init_distributed(1)
    yield
    process_groups.teardown()


def _base(shards, save_dir, *extra) -> list[str]:
    return [
        f"data.prefix=[{shards['prefix']}]",
        f"data.tokenizer={shards['tokenizer']}",
        *TINY,
        f"train.save_dir={save_dir}",
        *extra,
    ]


def _main(args: list[str], capsys) -> tuple[int, str]:
    from megahash.pretrain import main

    status = main(args)
    cap = capsys.readouterr()
    return status, cap.out + cap.err


def _records(run_dir: Path, split: str) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == split:
            out[rec["step"]] = {k: rec.get(k) for k in (COMPARED if split == "train" else ("loss", "tokens"))}
    return out


def _head_spec(shards, head: str) -> list[str]:
    """The first hash spec of the shards that ``head`` accepts (its constructor refuses the others)."""
    from megahash.accelerator import process_groups
    from megahash.config import load_config
    from megahash.errors import ConfigError
    from megahash.models.megatron_model import MegahashLM

    process_groups.init_distributed(1)
    try:
        for spec in shards["specs"]:
            try:
                MegahashLM(load_config(None, [*TINY, f"model.head={head}", f"model.embed.hash_spec={spec}"]), 1024)
                return [f"model.embed.hash_spec={spec}"]
            except ConfigError:
                continue
    finally:
        process_groups.teardown()
    raise AssertionError(f"no hash spec of {shards['specs']} suits head {head}")


def _overrides(shards, name: str) -> list[str]:
    extra = list(CONFIGS[name])
    if name.startswith("head-"):
        extra += _head_spec(shards, name[len("head-") :])
    return extra


def _straight(shards, runs, name: str, capsys, precision=BF16) -> Path:
    key = (name, tuple(precision))
    if key not in runs:
        d = runs["root"] / f"{name}-{'-'.join(p.split('=')[1] for p in precision)}"
        status, out = _main(_base(shards, d, *_overrides(shards, name), *precision), capsys)
        assert status == 0, out[-3000:]
        runs[key] = d
    return runs[key]


def _matrix_trains_validates_and_resumes(shards, runs, tmp_path, capsys, name: str, device: str) -> None:
    from megahash.accelerator import policy, process_groups

    assert policy.device().type == device and policy.autocast_args("bf16")["device_type"] == device
    # eager on CUDA too (auto compiles there): compiled layers through the engine are tests/test_gpu.py's, and
    # compiling the matrix's dozen models (one per kind) would take minutes of benchmarks/gpu_check.sh's nine
    precision = BF16 if device == "cpu" else [*BF16, "train.compile=false"]
    straight = _straight(shards, runs, name, capsys, precision)
    valid = _records(straight, "valid")
    assert sorted(valid) == [2, 4] and all(math.isfinite(v["loss"]) and v["tokens"] > 0 for v in valid.values()), valid
    resumed = tmp_path / "resumed"
    status, out = _main(
        _base(shards, resumed, *_overrides(shards, name), *precision, f"train.resume={straight / 'step_00000002'}"),
        capsys,
    )
    assert status == 0 and f"resumed from {straight}/step_00000002" in out and "torch.bfloat16" in out, out[-3000:]
    a, b = _records(straight, "train"), _records(resumed, "train")
    assert sorted(b) == [3, 4] and [a[3], a[4]] == [b[3], b[4]]  # bit-identical, as the uninterrupted run
    assert _records(resumed, "valid") == {4: valid[4]}
    from megahash.checkpoint.weights import load_for_inference

    try:
        _, model, _ = load_for_inference(straight)  # the saved weights are the fp32 master weights
        assert all(p.dtype == torch.float32 for p in model.parameters())
    finally:
        process_groups.teardown()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_trains_validates_saves_and_resumes_exactly(hashed_shards, straight_runs, tmp_path, capsys, name):
    """The crash of issue 33: the first bf16 validation died in megatron's frozen-weight linear path
    (autocast's bf16 weight copy does not require grad under no_grad). Now every configuration validates
    at steps 2 and 4, and resuming from step 2 repeats steps 3-4 and the step-4 validation bit for bit."""
    _matrix_trains_validates_and_resumes(hashed_shards, straight_runs, tmp_path, capsys, name, "cpu")


def _eval_requests():
    from lm_eval.api.instance import Instance

    ll = [
        Instance(request_type="loglikelihood", doc={}, arguments=(c, x), idx=0)
        for c, x in (("KING. My lord,", " the queen"), ("What says", " the king?"))
    ]
    gen = [
        Instance(
            request_type="generate_until",
            doc={},
            arguments=("KING. My lord,", {"until": ["\n"], "max_gen_toks": 6}),
            idx=0,
        )
    ]
    return ll, gen


@pytest.mark.parametrize(
    "name",
    [n for n, kinds in KIND_GROUPS.items() if all(k in _kinds.variants(decodes=True, exportable=True) for k in kinds)],
)
def test_bf16_checkpoint_evaluates_decodes_and_exports(hashed_shards, straight_runs, tmp_path, capsys, name):
    """A bf16 run's checkpoint: the lm-eval model scores and generates in the run's compute dtype (bf16
    autocast, ``accelerator.policy.compute_context``), its log-likelihoods within a bf16 tolerance of the same
    weights in fp32 (``train.precision=fp32`` override), and ``export-hf`` verifies the fp32 master weights'
    probe logits within 1e-3 (a bf16 export's within ``convert.verify.export_tolerance``); ``import-hf`` of
    the export continues in bf16 through a step and a validation."""
    from megahash.accelerator import process_groups
    from megahash.convert.export import export_hf
    from megahash.eval.lm import MegahashEvalLM

    ckpt = _straight(hashed_shards, straight_runs, name, capsys)
    ll, gen = _eval_requests()
    try:
        bf16 = MegahashEvalLM(checkpoint=str(ckpt), batch_size=2)
        fp32 = MegahashEvalLM(checkpoint=str(ckpt), batch_size=2, overrides="train.precision=fp32")
        assert bf16.precision == "bf16" and fp32.precision == "fp32"
        got, ref = bf16.loglikelihood(ll), fp32.loglikelihood(ll)
        # a log-likelihood sums log-softmax terms of bf16 logits: each logit is rounded to 2^-8 relative
        # (|logit| < 1 here), so a few tokens' sum moves by well under 0.05 nats
        assert all(math.isfinite(a) and abs(a - b) < 0.05 for (a, _), (b, _) in zip(got, ref)), (got, ref)
        text = bf16.generate_until(gen)
        assert isinstance(text[0], str) and bf16.decode_mode in ("incremental", "recompute")
        summary = export_hf(ckpt, tmp_path / "hf", verify=True)
        half = export_hf(ckpt, tmp_path / "hf16", dtype="bfloat16", verify=True)  # raises beyond its tolerance
    finally:
        process_groups.teardown()
    assert summary["verify"]["max_abs_diff"] <= 1e-3 and summary["verify"]["tokens"] > 0
    # bf16 weights: within 8 bf16 epsilons of the fp32 logits' scale (convert.verify.export_tolerance)
    assert 0 < half["verify"]["max_abs_diff"] <= half["verify"]["tolerance"]
    from megahash.convert.verify import load_hf

    hf = load_hf(tmp_path / "hf16", dtype=torch.bfloat16)  # transformers' generate() on the bf16 export
    prompt = torch.randint(5, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    new = hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=4,
        do_sample=False,
        min_new_tokens=4,
        pad_token_id=0,
    )
    # bit-exact: generate() returns the prompt ids unchanged (integers)
    assert new.shape == (1, 10) and torch.equal(new[:, :6], prompt)
    # import-hf of the export, then one more bf16 step (weights-only resume: fresh fp32 Adam state) and its validation
    from megahash.convert.importer import import_hf

    try:
        import_hf(tmp_path / "hf", tmp_path / "imported")
    finally:
        process_groups.teardown()
    import yaml

    imported = tmp_path / "imported" / "step_00000004"
    vocab = yaml.safe_load((imported / "resolved_config.yaml").read_text())["model"][
        "vocab_size"
    ]  # fixed by the import
    status, out = _main(
        _base(
            hashed_shards,
            tmp_path / "continued",
            *_overrides(hashed_shards, name),
            *BF16,
            "train.steps=5",
            f"model.vocab_size={vocab}",
            f"train.resume={imported}",
        ),
        capsys,
    )
    assert status == 0 and "torch.bfloat16" in out, out[-3000:]
    valid = _records(tmp_path / "continued", "valid")
    assert list(valid) == [5] and math.isfinite(valid[5]["loss"]), valid


# approx-thesis under bf16 autocast: issue 33 item 1 (its kernel's products drop to bf16; deliverable 2)
@pytest.mark.parametrize("kind", _kinds.variants(decodes=True))
def test_bf16_incremental_decoding_equals_the_full_forward(one_rank, kind):
    """Under bf16 autocast (``accelerator.policy.compute_context``) the incremental logits of every kind that
    decodes are within ``accelerator.policy.compute_tolerance`` (two bf16 epsilons of the logits' scale) of the
    full forward's, so megahash's lm-eval model decodes incrementally in bf16."""
    from megahash.accelerator import policy, rng
    from megahash.config import load_config
    from megahash.models.megatron_model import DecodeState, build_model

    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            "model.num_layers=2",
            f"model.schedule=uniform:{kind}",
            "data.seq_length=16",
            "model.attention.options.fixed_seq_length=16",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 256).eval()
    g = torch.Generator().manual_seed(1)
    for extra in model.kind_inputs():
        if getattr(extra, "source", "") == "text":  # a fixed text as token ids (fixedseqqk)
            extra.set_tokens(torch.randint(5, 256, (16,), generator=g))
    tok = torch.randint(5, 256, (2, 12), generator=g)
    with torch.no_grad(), policy.compute_context("bf16", "cpu"):
        full = model(tok).float()
        state = DecodeState(2)
        model(tok[:, :6], decode_state=state)
        steps = torch.cat([model(tok[:, k : k + 1], decode_state=state).float() for k in range(6, 12)], 1)
    assert full.dtype == torch.float32 and torch.isfinite(full).all()
    tol = policy.compute_tolerance("bf16", "cpu")
    assert float((steps - full[:, 6:]).abs().max()) <= tol * max(1.0, float(full.abs().max()))


def test_bf16_validation_loss_is_within_tolerance_of_fp32(hashed_shards, straight_runs, capsys):
    """The same data, seed and weights at step 0: the bf16 run's validation losses at steps 2 and 4 are
    within 0.02 nats of the fp32 run's. Why 0.02: the loss is a mean over tokens of log-sum-exp minus the
    target logit, computed in fp32 from bf16 logits (each rounded to 2^-8 relative, |logit| < 1 at init
    std 0.02: < 0.004 per token, and the rounding errors of the mean partly cancel); the 4 AdamW
    steps of bf16 gradients move the weights by another few 1e-3 relative. Measured here: 6.6e-5 (step 2)
    and 2.2e-5 (step 4); the quickstart model over 100 steps (README): at most 8.5e-3 (step 75)."""
    name = next(n for n in CONFIGS if n.startswith("embedding-"))  # any configuration; the first hash embedding
    bf16 = _records(_straight(hashed_shards, straight_runs, name, capsys), "valid")
    fp32 = _records(
        _straight(hashed_shards, straight_runs, name, capsys, ["train.precision=fp32", "train.zero_stage=1"]), "valid"
    )
    print(f"\nvalidation loss fp32 {fp32} bf16 {bf16}")
    assert sorted(bf16) == sorted(fp32) == [2, 4]
    for step in (2, 4):
        assert bf16[step]["tokens"] == fp32[step]["tokens"]
        assert abs(bf16[step]["loss"] - fp32[step]["loss"]) < 0.02, (step, bf16, fp32)


def test_cpu_linear_shim_passes_megatron_arguments_on_unchanged():
    """The root cause of the validation crash: the oneDNN shim re-passed megatron's arguments by position
    (and a ``wgrad_deferral_limit`` of 0), which ``linear_with_frozen_weight`` reads in another order."""
    from megahash.models import cpu_linear

    seen = {}

    def fallback(input, weight, bias=None, **kwargs):
        seen.update(kwargs)
        return "fallback"

    x, w = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16)  # bf16: not oneDNN's
    given = {
        "gradient_accumulation_fusion": False,
        "allreduce_dgrad": False,
        "sequence_parallel": False,
        "grad_output_buffer": None,
        "wgrad_deferral_limit": None,
        "tp_group": None,
    }
    assert cpu_linear._forward_impl(fallback)(input=x, weight=w, bias=None, **given) == "fallback" and seen == given


@pytest.mark.parametrize("onednn", ["1", "0"])
def test_no_grad_bf16_forward_through_megatron_linears(one_rank, monkeypatch, onednn):
    """Validation's case in the model: under ``torch.no_grad`` and bf16 autocast the linear layers take
    megatron's frozen-weight path, with the CPU shim (``1``) and without it (``0``: the route CUDA takes),
    and give the same logits as the grad-enabled path."""
    from megahash.accelerator import policy, rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model

    monkeypatch.setenv("MEGAHASH_ONEDNN_LINEAR", onednn)
    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_heads=2",
            "model.ffn_hidden_size=64",
            "model.num_layers=1",
            "data.seq_length=16",
        ],
    )
    rng.seed_all(0)
    model = build_model(cfg, 256)
    tok = torch.randint(5, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with policy.compute_context("bf16", "cpu"):
        with torch.no_grad():
            frozen = model(tok)
        trained = model(tok)
    # bit-exact: one path, the same bf16 GEMMs on the same inputs with and without weight gradients
    assert torch.equal(frozen, trained.detach())  # the same bf16 GEMMs, with and without weight gradients


def test_accelerator_picks_cuda_autocast_for_a_cuda_device():
    """The decision, without a GPU: bf16 under autocast on the CUDA device for ``auto`` and ``bf16``,
    CPU autocast for ``bf16`` on CPU, none for fp32 (and ``auto`` on CPU)."""
    from megahash.accelerator import policy

    cuda = {"device_type": "cuda", "dtype": torch.bfloat16}
    assert policy.autocast_args("auto", torch.device("cuda")) == cuda
    assert policy.autocast_args("bf16", "cuda:1") == cuda
    assert policy.autocast_args("bf16", "cpu") == {"device_type": "cpu", "dtype": torch.bfloat16}
    assert policy.autocast_args("auto", "cpu") is None and policy.autocast_args("fp32", "cuda") is None
    assert policy.training_settings("auto", "auto", "cuda")["autocast"] == cuda
    assert policy.compute_tolerance("bf16", "cuda") == 2 * 2.0**-7 and policy.compute_tolerance("fp32") == 1e-3
    with policy.compute_context("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with policy.compute_context("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.slow
def test_bf16_sweep_and_launches_stop_resume_elsewhere_evaluate_and_export(shakespeare_shards, tmp_path):
    """The subprocess path: ``megahash sweep`` runs a bf16 cell (a ``pretrain.py`` launch to step 4, then
    its evaluation in the run's compute dtype, then the report); the pretraining entry point (in this process)
    with the same config validates and stops at step 2 with its checkpoint, is run again at another layout
    (ZeRO-3 instead of ZeRO-1: the elastic resume through the dist checkpoints) to step 4, with the sweep
    cell's validation losses (step 2 bit for bit, step 4 within bf16 tolerance: another summation order
    after the resume); ``megahash export-hf`` verifies the resumed checkpoint."""
    import yaml

    from megahash.data.preprocess import make_eval_tasks

    common = [
        f"data.prefix=[{shakespeare_shards['prefix']}]",
        f"data.tokenizer={shakespeare_shards['tokenizer']}",
        *TINY,
        "model.num_layers=2",
        "model.schedule=hybrid:approx:even",
        "train.precision=bf16",
        "train.zero_stage=1",
    ]
    tasks = tmp_path / "tasks"
    assert (
        make_eval_tasks.main(
            [
                "--source",
                "shakespeare",
                "--out",
                str(tasks),
                "--held-out-docs",
                "1100:",
                "--n",
                "8",
                "--ppl-docs",
                "1",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    grid = {
        "name": "bf16",
        "config": "quickstart.yaml",
        "overrides": {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in common)},
        "variants": [{"name": "bf16", "overrides": {}}],
        "eval": {"tasks_dir": str(tasks), "tasks": ["shk_ppl", "shk_order"], "limit": 4},
    }
    (tmp_path / "grid.yaml").write_text(yaml.safe_dump(grid))
    out = tmp_path / "sweep"
    r = run([sys.executable, "-m", "megahash", "sweep", "--grid", str(tmp_path / "grid.yaml"), "--out", str(out)])
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    cell = next((out / "cells").iterdir())
    rec = json.loads(next((cell / "eval").glob("step_*.json")).read_text())
    assert (
        rec["step"] == 4
        and rec["model_args"]["precision"] == "bf16"
        and set(rec["results"]) == {"shk_ppl", "shk_order"}
    )
    d = tmp_path / "run"
    r = pretrain_here([*common, f"train.save_dir={d}", "train.stop_after=2"], config="configs/quickstart.yaml")
    assert r.returncode == 0 and "[valid] step 2/4" in r.stdout + r.stderr, r.stderr[-3000:]
    r = pretrain_here([*common[:-1], f"train.save_dir={d}", "train.zero_stage=3"], config="configs/quickstart.yaml")
    assert r.returncode == 0 and f"resumed from {d}" in r.stdout + r.stderr, r.stderr[-3000:]
    a, b = _records(cell, "valid"), _records(d, "valid")
    assert sorted(b) == [2, 4] and a[2] == b[2] and abs(a[4]["loss"] - b[4]["loss"]) < 0.02, (a, b)
    r = megahash_here(["export-hf", "--checkpoint", str(d), "--output", str(tmp_path / "hf")])
    assert r.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_matrix_on_cuda(hashed_shards, straight_runs, tmp_path, capsys, name):
    """The twin of the CPU matrix on a CUDA device (``train.precision=bf16``, autocast device 'cuda')."""
    from megahash.accelerator import policy

    assert policy.autocast_args("bf16")["device_type"] == "cuda"
    _matrix_trains_validates_and_resumes(hashed_shards, straight_runs, tmp_path, capsys, name, "cuda")
