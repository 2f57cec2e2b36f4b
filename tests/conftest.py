"""Shared fixtures: real-text shards built once per session with the data tools, and a runner
for megahash entry points in fresh processes (deepspeed launcher for 2 gloo ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Under pytest-xdist (.ci/run: ``-n 2 --dist loadscope --no-loadscope-reorder``) a test module is one
# unit of work (loadscope's own rule, no marker needed), so its module fixtures are built once. Units go
# out in this order, longest first (measured on the 2-core machine), so the two workers finish together.
# The two modules that start a local SLURM take turns through LocalSlurm's machine-wide lock; test_sweep
# goes last so that it never waits on test_slurm's cluster while the other worker idles.
LONGEST_FIRST = ["test_slurm", "test_training", "test_faults", "test_grids_run", "test_resume_every_config", "test_readme",
                 "test_convert", "test_diagnose",
                 "test_tokenizers", "test_eval", "test_validation", "test_launch", "test_new_kind", "test_attention",
                 "test_embeddings"]
LAST = ["test_sweep"]


def pytest_collection_modifyitems(config, items):
    gpu_skip = None
    if any(item.get_closest_marker("gpu") for item in items):
        from megahash import accelerator

        if not accelerator.has_gpu():
            gpu_skip = pytest.mark.skip(reason="gpu: no CUDA device on this machine (benchmarks/gpu_check.sh runs these on one)")
    for item in items:
        if gpu_skip is not None and item.get_closest_marker("gpu"):
            item.add_marker(gpu_skip)
    order = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    order.update({unit: len(order) + 1 + i for i, unit in enumerate(LAST)})
    items.sort(key=lambda item: order.get(item.path.stem, len(LONGEST_FIRST)))  # stable: file order within a module


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled",
                "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    # launch/install_cpu.sh and quickstart.sh (tests/test_readme.py, test_launch.py) use the tests' own Python:
    # its virtual environment, or the Python itself (none) when it is not one; never a new .venv in a copy
    env.setdefault("MEGAHASH_VENV", sys.prefix if sys.prefix != sys.base_prefix else "none")
    env.update({k: str(v) for k, v in extra.items()})
    return env


@pytest.fixture(scope="module")
def dist():
    """This process as a one-rank megatron/torch.distributed world for in-process model tests."""
    from megahash import accelerator

    accelerator.init_distributed(1)
    yield
    accelerator.teardown()


def run(args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run a command from the repository root, capturing output."""
    return subprocess.run(args, cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def pretrain(overrides: list[str], ranks: int = 1, config: str | None = None, timeout: int = 600, **env):
    """Launch megahash/pretrain.py on ``ranks`` CPU processes (DeepSpeed launcher for > 1)."""
    cfg = ["--config", config] if config else []
    if ranks == 1:
        cmd = [sys.executable, "megahash/pretrain.py", *cfg, *overrides]
    else:
        port = _free_port()
        cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(port), "megahash/pretrain.py", *cfg,
               *overrides]
        r = run(cmd, timeout=timeout, **env)
        # DeepSpeed's CPU all-reduce buffers (/dev/shm, 69 MB a rank) must not outlive a finished run
        left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert r.returncode != 0 or not left, f"leaked shared memory: {left}"
        return r
    return run(cmd, timeout=timeout, **env)


def _free_port() -> int:
    from megahash.launching.env import free_port

    return free_port()


def train_losses(run_dir, split: str = "train") -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl (last record of a step wins)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == split:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory) -> dict:
    """A sentencepiece BPE model and token shards (md5 + lsh128 side shards) of real Shakespeare
    text, built with the real data tools."""
    d = tmp_path_factory.mktemp("shards")
    spm = d / "spm"
    r = run([sys.executable, "data_tools/train_tokenizer.py", "--input", "shakespeare", "--output", str(spm),
             "--vocab-size", "1000", "--max-docs", "200"])
    assert r.returncode == 0, r.stderr[-2000:]
    prefix = d / "shakespeare"
    r = run([sys.executable, "data_tools/preprocess_data.py", "--input", "shakespeare", "--output-prefix", str(prefix),
             "--tokenizer", f"{spm}.model", "--word-hashes", "md5,lsh128", "--workers", "2", "--max-docs", "400",
             "--quiet"])
    assert r.returncode == 0, r.stderr[-2000:]
    return {"prefix": str(prefix), "tokenizer": f"{spm}.model", "dir": d}
