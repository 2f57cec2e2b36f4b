"""Every command block of the README runs, as written and in order, on a fresh copy of the
repository, after the quickstart. Commands are only shortened by arguments appended at the end
(later config overrides and later argparse options win); a command no rule knows fails the test,
so a new README command must be given a rule here. Heavy or unreachable ones are skipped with the
reason in SKIP. The launchers (deepspeed, torchrun) and the quickstart's own commands start fresh processes; the
README's `python ...` and `megahash ...` lines are forked from a server that imported torch/DeepSpeed/megatron-core
already (tests/_fork_shim.py; MEGAHASH_TEST_FRESH=1 runs them in fresh interpreters too)."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import _fork_shim
import _forkserver
import pytest

from conftest import ROOT, child_env

SHORT_TRAIN = ["train.steps=2"]
# command prefix -> arguments appended (shortening only)
RULES = [
    ("bash launch/quickstart.sh", ["train.steps=4", "train.eval_interval=2"]),
    ("python data_tools/train_tokenizer.py", ["--doc-range", "0:200", "--vocab-size", "1000"]),
    ("python data_tools/preprocess_data.py", ["--doc-range", "0:300", "--quiet"]),
    ("python data_tools/inspect_shards.py", []),
    ("deepspeed --num_gpus 2 megahash/pretrain.py", SHORT_TRAIN),
    ("torchrun --nproc_per_node 2 megahash/pretrain.py", SHORT_TRAIN),
    ("python megahash/pretrain.py", SHORT_TRAIN),
    ("megahash params", []),
    ("python data_tools/make_eval_tasks.py", ["--n", "10", "--ppl-docs", "3"]),
    ("megahash eval --checkpoint runs/quickstart --tasks-dir", ["--limit", "4"]),
    ("megahash indicators", ["--no-plots"]),
    ("megahash report", []),
    ("python -m launch --dry-run", []),
    ("megahash export-hf", []),
    ("megahash import-hf", []),
    ("megahash sweep --grid configs/grids/table4_1_tiny.yaml --dry-run", []),
    ("megahash diagnose", ["--steps", "3", "--eval-samples", "8"]),
]
SKIP = {
    "bash .ci/run": "it is this test suite",
    "megahash eval --checkpoint runs/quickstart --tasks arc_easy": "lm-eval's own tasks download from the Hugging Face hub (offline here)",
    "sbatch": "needs a SLURM allocation of GPU nodes (the scripts are tested on a local SLURM in tests/launching/test_slurm.py)",
    "DATA_PREFIX=": "needs a SLURM allocation and the Pile (tests/launching/test_slurm.py runs the script on a local SLURM)",
    "deepspeed --hostfile": "needs two hosts with 8 GPUs",
    "megahash sweep --grid configs/grids/table4_1_tiny.yaml --launcher local": "trains all 8 cells (minutes each); tests/experiments/test_sweep.py runs a 2x2 tiny grid end to end, locally and on SLURM",
}


def readme_commands(text: str) -> list[str]:
    """Commands of the ```bash blocks: continuation lines joined, trailing comments dropped."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                cmds.append(re.sub(r"\s+", " ", line))
    return cmds


def fresh_copy(dst: Path) -> None:
    """The repository as a clone has it: tracked and not-ignored files only (no data/, no runs/)."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_commands_run_in_order(shakespeare_shards, tmp_path):
    repo = tmp_path / "clone"
    fresh_copy(repo)
    # the data the quickstart would build, small: the session's shards under the quickstart's names
    data = repo / "data" / "shakespeare"
    data.mkdir(parents=True)
    shutil.copy2(shakespeare_shards["tokenizer"], data / "spm.model")
    for f in Path(shakespeare_shards["dir"]).glob("shakespeare_*"):
        shutil.copy2(f, data / f.name)
    # launchers default to port 29500: give each launch a free port (as a cluster's launcher would),
    # so the test does not collide with other jobs on the machine; the commands stay as written
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, flag in (("deepspeed", "--master_port"), ("torchrun", "--master-port")):
        real = shutil.which(name)
        (shims / name).write_text(
            "#!/usr/bin/env bash\n"
            f"port=$({sys.executable} -c 'from megahash.launching.env import free_port; print(free_port())')\n"
            f'exec {real} {flag} "$port" "$@"\n'
        )
        (shims / name).chmod(0o755)
    env = child_env(PYTHONPATH=str(repo))
    env["PATH"] = f"{shims}:{env['PATH']}"
    server = None
    if _forkserver.wanted():
        # `python ...` and `megahash ...` forked from a server that imported torch/DeepSpeed/megatron-core under
        # this environment (tests/_fork_shim.py): each runs as in a fresh interpreter, its megahash modules
        # imported by itself, without ~5 CPU-s of third-party imports. The quickstart's python3 (its own
        # environment's: launch/venv.sh) and the launchers and their ranks stay fresh processes.
        server = _forkserver._Server(env)
        _fork_shim.install(shims, server, {"python": None, "megahash": shutil.which("megahash")})
    r = subprocess.run(
        [
            sys.executable,
            "data_tools/make_eval_tasks.py",
            "--source",
            "shakespeare",
            "--held-out-docs",
            "1100:",
            "--out",
            "data/eval_tasks",
            "--n",
            "10",
            "--ppl-docs",
            "3",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]

    cmds = readme_commands((ROOT / "README.md").read_text())
    assert cmds[0] == "bash launch/quickstart.sh", cmds[:2]
    ran, skipped = [], []
    try:
        for cmd in cmds:
            reason = next((why for p, why in SKIP.items() if cmd.startswith(p)), None)
            if reason:
                skipped.append(cmd)
                continue
            extra = next((args for p, args in RULES if cmd.startswith(p)), None)
            assert extra is not None, f"README command without a rule in tests/test_readme.py: {cmd}"
            full = cmd + "".join(" " + shlex.quote(a) for a in extra)
            r = subprocess.run(["bash", "-c", full], cwd=repo, env=env, capture_output=True, text=True, timeout=1200)
            assert r.returncode == 0, f"{full}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            ran.append((cmd, r))
    finally:
        if server is not None:
            server.close()
    assert {p for p in SKIP if any(c.startswith(p) for c in skipped)} == set(SKIP) and len(ran) >= 15
    out = dict((c, r.stdout) for c, r in ran)
    qs = out["bash launch/quickstart.sh"]
    assert "after 4 steps" in qs and "quickstart: [6/6]" in qs
    for d in (
        "runs/quickstart/step_00000004",
        "runs/tp2sp/step_00000002",
        "runs/torchrun/step_00000002",
        "runs/one_rank/step_00000002",
        "runs/quickstart/indicators",
        "hf/quickstart",
        "runs/continued",
    ):
        assert (repo / d).exists(), d
    assert (repo / "data/eval_tasks/shk_held_out.txt").stat().st_size > 1000
