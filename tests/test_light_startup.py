"""Start-up: config validation and `megahash params` run before and without the heavy imports
(checked through sys.modules, not time), and the closed-form count equals the real model's."""

import json
import subprocess
import sys

from conftest import ROOT, child_env

HEAVY = ("torch", "megatron", "deepspeed", "lm_eval", "transformers")

PROBE = r"""
import contextlib, io, json, sys
from megahash.cli import main as cli
from megahash.pretrain import main as pretrain
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    codes = [cli(["params", "--config", "configs/model/500m.yaml", "--json"]),
             pretrain(["--config", "configs/quickstart.yaml", "model.schedule=hybrid:rndembqk:evn"]),
             pretrain(["--config", "configs/quickstart.yaml", "model.schedule=uniform:mhaa"]),
             pretrain(["--config", "configs/quickstart.yaml", "model.embedding=hash_emb"]),
             pretrain(["--config", "configs/quickstart.yaml", "train.decay=cosin"])]
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
print(json.dumps({"codes": codes, "heavy": heavy, "report": json.loads(out.getvalue()), "err": err.getvalue()}))
"""


def test_params_and_config_errors_without_heavy_imports():
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *HEAVY], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["heavy"] == [], res["heavy"]
    assert res["codes"] == [0, 2, 2, 2, 2]
    assert res["report"]["total"] == 436_037_504  # DESIGN.md / tests/models/test_params.py: 500M tied
    errs = res["err"].strip().splitlines()
    assert len(errs) == 4 and all(e.startswith("error: ") for e in errs), errs
    assert "unknown hybrid preset 'evn'" in errs[0]
    assert "unknown attention kind 'mhaa'" in errs[1] and "did you mean 'mha'" in errs[1]
    assert "unknown model.embedding 'hash_emb'" in errs[2] and "did you mean 'hash-emb'" in errs[2]
    assert "'train.decay' must be" in errs[3]


CHECK = r"""
import json, sys
from megahash.config import load_config
from megahash.models.accounting import count_parameters
from megahash.models.closed_form import closed_form_report
out = []
for ov in json.loads(sys.argv[1]):
    cfg = load_config("configs/quickstart.yaml", ov)
    fast = closed_form_report(cfg, 4000)
    slow = count_parameters(load_config("configs/quickstart.yaml", ov), 4000)
    slow.pop("costs", None); fast.pop("costs", None)
    out.append(fast == slow or [fast, slow])
print(json.dumps(out))
"""


def test_closed_form_equals_meta_model():
    variants = [
        [],
        ["model.tie_embeddings=false"],
        ["model.num_query_groups=2"],
        ["model.qkv_bias=false"],
        ["model.schedule=list:mha,mqa,mqa,mha"],
        ["model.schedule=list:gqa,mqa,gqa,mha"],
        ["model.size=500m", "model.num_layers=2", "model.tie_embeddings=false"],
    ]
    r = subprocess.run(
        [sys.executable, "-c", CHECK, json.dumps(variants)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True] * len(variants)


INPUTS_PROBE = r"""
import contextlib, io, json, sys
from megahash.pretrain import main as pretrain
prefix, tok, text, small, other, rundir, heavy_names = *sys.argv[1:7], sys.argv[7:]
base = ["--config", "configs/quickstart.yaml", f"data.prefix=[{prefix}]", "train.save_dir=/nonexistent/run"]
cases = [[f"data.tokenizer={text}"], ["data.tokenizer=/nonexistent/spm.model"], [f"data.tokenizer={tok}", "data.prefix=[/nonexistent/shk]"],
         [f"data.tokenizer={tok}", "train.resume=/nonexistent/step_00000004"],
         [f"data.tokenizer={tok}", "eval.at_end=true", "eval.tasks_dir=/nonexistent/tasks"],
         [f"data.tokenizer={small}"], [f"data.tokenizer={other}"], [f"data.tokenizer={tok}", f"train.resume={rundir}"],
         [f"data.tokenizer={tok}", "train.steps=1e30"],
         [f"data.tokenizer={tok}", "model.embedding=hash-emb", "model.embed.hash_spec=md5-bucket1038"]]
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    codes = [pretrain(base + c) for c in cases]
    codes.append(pretrain(["--check", "inputs", *base, f"data.tokenizer={tok}"]))
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(heavy_names))
print(json.dumps({"codes": codes, "heavy": heavy, "out": out.getvalue(), "err": err.getvalue()}))
"""


def test_missing_or_wrong_inputs_fail_before_heavy_imports(shakespeare_shards, tmp_path):
    """data.tokenizer that is a text file or no file, a missing shard prefix, a resume path that is no
    checkpoint, a missing eval.tasks_dir, train.steps past any index the machine can hold (megatron-core's
    builder counted the epochs of 1e30 for ever), a model reading a hash spec the shards lack: one line each,
    exit 2, before torch is imported (issue 29);
    `--check inputs` on good inputs prints train.save_dir."""
    from megahash.data.preprocess import train_tokenizer

    text = tmp_path / "notes.txt"
    text.write_text("these are notes, not a tokenizer\n" * 50)
    run_dir = tmp_path / "run"  # a run directory given as train.resume (its checkpoint: a step_N with a state file)
    (run_dir / "step_00000004").mkdir(parents=True)
    (run_dir / "step_00000004" / "megahash_state.json").write_text("{}")
    # real tokenizers, not the shards' one: a smaller vocabulary, and the same size from other documents
    for name, vocab, docs in (("small", "500", "0:100"), ("other", "1000", "300:500")):
        assert (
            train_tokenizer.main(
                [
                    "--input",
                    "shakespeare",
                    "--doc-range",
                    docs,
                    "--output",
                    str(tmp_path / name),
                    "--vocab-size",
                    vocab,
                    "--quiet",
                ]
            )
            == 0
        )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            INPUTS_PROBE,
            shakespeare_shards["prefix"],
            shakespeare_shards["tokenizer"],
            str(text),
            str(tmp_path / "small.model"),
            str(tmp_path / "other.model"),
            str(run_dir),
            *HEAVY,
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["heavy"] == [] and res["codes"] == [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0], res
    errs = res["err"].strip().splitlines()
    assert len(errs) == 10 and all(e.startswith("error: ") for e in errs), errs
    # a hash spec the shards lack: found by the dataset builder alone, after torch (and a queue's wait) before
    side = f"{shakespeare_shards['prefix']}_hash_md5-bucket1038.bin/.idx does not exist"
    assert side in errs[9] and "--word-hashes md5-bucket1038" in errs[9] and "['lsh128', 'md5']" in errs[9], errs[9]
    assert "train samples of 128 tokens need" in errs[8] and "lower train.steps" in errs[8], errs[8]
    assert "small.model' has 500 entries, the shards' tokenizer 1000" in errs[5]
    assert "other.model' is not the tokenizer the shards were made with (sha256 differs)" in errs[6]
    assert f"data.tokenizer: cannot load sentencepiece model {str(text)!r}" in errs[0]
    assert "tokenizer not found: '/nonexistent/spm.model'" in errs[1]
    assert shakespeare_shards["tokenizer"] in errs[0] and shakespeare_shards["tokenizer"] in errs[1]  # the shards' own
    assert "data shard /nonexistent/shk_text_document.bin does not exist" in errs[2]
    assert "train.resume=/nonexistent/step_00000004 is not a complete megahash checkpoint" in errs[3]
    # a run directory: the checkpoint to name instead (it was "is not a complete megahash checkpoint" alone)
    assert (
        f"is a run directory, not a checkpoint; name one of its checkpoints, e.g. train.resume={run_dir}/step_00000004"
        in errs[7]
    )
    assert "eval.tasks_dir /nonexistent/tasks does not exist" in errs[4]
    assert res["out"] == "/nonexistent/run\n"


CLI_PROBE = r"""
import contextlib, io, json, sys
from megahash.cli import main as cli
from megahash.experiments.diagnose import main as diagnose
calls = [["eval", "--checkpoint", "/nonexistent/run", "--tasks", "shk_ppl"],
         ["eval", "--checkpoint", ".", "--tasks-dir", "/nonexistent/tasks", "--tasks", "shk_ppl"],
         ["indicators", "--checkpoint", "/nonexistent/run", "--text", "README.md"],
         ["indicators", "--checkpoint", ".", "--text=/nonexistent.txt"],
         ["report", "--runs", ".", "/nonexistent/run2", "--out", "/tmp/r.md"],
         ["export-hf", "--checkpoint", "/nonexistent/run", "--output", "/nonexistent/hf"],
         ["import-hf", "--hf", "/nonexistent/hf", "--output", "/nonexistent/run"],
         ["diagnose", "--config", "/nonexistent/model.yaml", "--kinds", "mha"]]
err = io.StringIO()
with contextlib.redirect_stderr(err):
    codes = [cli(c) for c in calls]
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
print(json.dumps({"codes": codes, "heavy": heavy, "err": err.getvalue()}))
"""


def test_missing_paths_of_subcommands_fail_before_heavy_imports():
    r = subprocess.run(
        [sys.executable, "-c", CLI_PROBE, *HEAVY],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["heavy"] == [] and res["codes"] == [2] * 8, res
    assert res["err"].strip().splitlines() == [
        "error: checkpoint /nonexistent/run does not exist",
        "error: --tasks-dir /nonexistent/tasks does not exist",
        "error: checkpoint /nonexistent/run does not exist",
        "error: --text /nonexistent.txt does not exist",
        "error: checkpoint /nonexistent/run2 does not exist",
        "error: checkpoint /nonexistent/run does not exist",
        "error: --hf /nonexistent/hf does not exist",
        "error: config file '/nonexistent/model.yaml' does not exist",
    ]


LAZY_PROBE = r"""
import json, sys
import megahash, megatron.core
from megatron.core.fusions.fused_bias_swiglu import swiglu
from megatron.core.inference.contexts import dynamic_context
imported_inductor = "torch._inductor.compile_fx" in sys.modules
loggers = sorted({"wandb", "torch.utils.tensorboard"} & set(sys.modules))
from megatron.core import timers
fallbacks = [timers.wandb, timers.SummaryWriter, dynamic_context.wandb]
import wandb
from torch.utils.tensorboard import SummaryWriter  # still importable, for logging.wandb / logging.tensorboard
import torch
x = torch.randn(3, 8, dtype=torch.float64)
a, b = torch.chunk(x, 2, -1)
ref = torch.nn.functional.silu(a) * b  # megatron's swiglu: silu(x1) * x2 of the two halves
out = swiglu(x)
print(json.dumps({"inductor_at_import": imported_inductor, "err": (out - ref).abs().max().item(),
                  "compiled": hasattr(swiglu._fused, "_torchdynamo_orig_callable"), "loggers": loggers,
                  "fallbacks": fallbacks, "later": [wandb.__name__, SummaryWriter.__name__]}))
"""


def test_megatron_fusers_compile_on_first_call_not_at_import():
    """megahash/lazy_fusers.py: importing megatron-core after megahash builds no compiled function
    (no inductor import); a fused function still gives megatron's formula and is the torch.compile'd
    one once called. Its timers and dynamic inference context import no logger (wandb, TensorBoard: their
    fallbacks None), which stay importable afterwards."""
    r = subprocess.run(
        [sys.executable, "-c", LAZY_PROBE], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["inductor_at_import"] is False and res["compiled"] is True
    assert res["loggers"] == [] and res["fallbacks"] == [None, None, None]
    assert res["later"] == ["wandb", "SummaryWriter"]
    assert res["err"] < 1e-12  # fp64 (inductor's CPU kernel vs eager: a few ulps)
