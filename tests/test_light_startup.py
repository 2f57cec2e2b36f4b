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
    r = subprocess.run([sys.executable, "-c", PROBE, *HEAVY], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["heavy"] == [], res["heavy"]
    assert res["codes"] == [0, 2, 2, 2, 2]
    assert res["report"]["total"] == 436_037_504  # DESIGN.md / tests/test_params.py: 500M tied
    errs = res["err"].strip().splitlines()
    assert len(errs) == 4 and all(e.startswith("error: ") for e in errs), errs
    assert "unknown hybrid preset 'evn'" in errs[0]
    assert "unknown attention kind 'mhaa'" in errs[1] and "did you mean 'mha'" in errs[1]
    assert "unknown model.embedding 'hash_emb'" in errs[2] and "did you mean 'hash-emb'" in errs[2]
    assert "train.decay must be" in errs[3]


CHECK = r"""
import json, sys
from megahash.config import load_config
from megahash.models.accounting import count_parameters
from megahash.models.light import closed_form_report
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
    variants = [[], ["model.tie_embeddings=false"], ["model.num_query_groups=2"], ["model.qkv_bias=false"],
                ["model.schedule=list:mha,mqa,mqa,mha"], ["model.schedule=list:gqa,mqa,gqa,mha"], ["model.size=500m", "model.num_layers=2", "model.tie_embeddings=false"]]
    r = subprocess.run([sys.executable, "-c", CHECK, json.dumps(variants)], cwd=ROOT, env=child_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [True] * len(variants)
