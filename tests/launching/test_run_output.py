"""What a researcher sees: a bad config on 2 ranks prints ONE error line (not one per rank), and a
requeued run continues the same wandb run (offline mode, real wandb)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env, pretrain_group, run
from megahash import known_warnings


@pytest.mark.multiprocess
def test_error_printed_once_for_all_ranks(tmp_path):
    (r,) = pretrain_group([["--config", "configs/quickstart.yaml", "train.decay=cosin", f"train.save_dir={tmp_path}"]])
    assert r.returncode != 0
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "error: " in l and "train.decay" in l]
    assert len(lines) == 1 and lines[0].startswith("error: config key 'train.decay' must be"), (
        r.stdout[-2000:] + r.stderr[-2000:]
    )
    assert "Traceback" not in r.stderr


WANDB = r"""
import json, sys, time
from megahash.config import load_config
from megahash.training.logging import RunLogger
cfg = load_config(None, ["logging.wandb=true", "logging.wandb_mode=offline", "logging.tensorboard=false",
                         f"train.save_dir={sys.argv[1]}"])
ids = []
for attempt in range(2):  # the first job, then its requeue
    if attempt:  # wandb names a run's folder by the second it started: a real requeue is never within it
        time.sleep(1.1)
    log = RunLogger(cfg, 0)
    log.log(attempt + 1, {"loss": 1.0 / (attempt + 1), "consumed_tokens": 64 * (attempt + 1)})
    ids.append(log.wandb.id)
    log.close()
print(json.dumps(ids))
"""


def test_wandb_resumes_the_same_run_id(tmp_path):
    r = run([sys.executable, "-c", WANDB, str(tmp_path)], WANDB_MODE="offline")
    assert r.returncode == 0, r.stderr[-3000:]
    ids = json.loads(r.stdout.strip().splitlines()[-1])
    assert ids[0] == ids[1] == (tmp_path / "wandb_run_id").read_text().strip()
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}"))) == 2  # two attempts, one run id


BARS = r"""
import sys
from megahash import known_warnings
known_warnings.install()  # as every entry point does first
import datasets
from tqdm import tqdm
for _ in tqdm(range(3), desc="requests"):
    pass
datasets.load_dataset("json", data_files={"test": sys.argv[1]}, cache_dir=sys.argv[2])
"""


def test_progress_bars_stay_out_of_logs_unless_verbose(tmp_path):
    """stderr that is no terminal (a log file, a pipe) gets no tqdm bars and no datasets "Generating test
    split" lines (issue 36); MEGAHASH_SHOW_WARNINGS=1 (what --verbose sets) shows them."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    outs = {}
    for verbose in ("0", "1"):
        env = child_env(MEGAHASH_SHOW_WARNINGS=verbose)
        for var in known_warnings.NO_PROGRESS_BARS:  # set in this worker by an earlier in-process entry point
            env.pop(var, None)
        r = subprocess.run(
            [sys.executable, "-c", BARS, str(data), str(tmp_path / f"cache{verbose}")],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        outs[verbose] = r.stdout + r.stderr
    assert "requests" not in outs["0"] and "Generating test split" not in outs["0"] and "it/s" not in outs["0"], outs[
        "0"
    ]
    assert "requests: 100%" in outs["1"] and "Generating test split" in outs["1"], outs["1"]
