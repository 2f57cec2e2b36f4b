"""Packaging (issue 19 item 5): a wheel built from the repository installs into a fresh virtual
environment and runs from any directory: its configs are package data (``megahash params --config
500m`` finds ``configs/model/500m.yaml`` without the checkout), and it claims no generic top-level
package names (``data_tools``, ``launch`` stay repository entry scripts)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

from conftest import ROOT, child_env


def test_wheel_installs_and_runs_params_from_any_directory(tmp_path):
    # build from a copy (setuptools writes build/ and *.egg-info beside the sources)
    src = tmp_path / "src"
    shutil.copytree(ROOT / "megahash", src / "megahash", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", src / "configs")
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("megahash-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"megahash"}, tops
    shipped = {n for n in names if n.startswith("megahash/configs/")}
    assert {
        "megahash/configs/model/500m.yaml",
        "megahash/configs/deepspeed/zero1.json",
        "megahash/configs/quickstart.yaml",
        "megahash/configs/grids/table4_1_tiny.yaml",
    } <= shipped, sorted(shipped)

    # a fresh venv that sees the system's torch & co, with the wheel installed; run it far from the checkout
    venv = tmp_path / "venv"
    r = subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        [str(py), "-c", "import megahash, os; print(os.path.dirname(megahash.__file__))"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.stdout.strip().startswith(str(venv)), r.stdout + r.stderr
    r = subprocess.run(
        [str(venv / "bin" / "megahash"), "params", "--config", "500m", "--json"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    installed = json.loads(r.stdout)
    # the same report as the checkout's, from the checkout's config file
    r = subprocess.run(
        [sys.executable, "-m", "megahash", "params", "--config", "configs/model/500m.yaml", "--json"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert installed == json.loads(r.stdout) and installed["total"] > 4e8
    # a user's own path still wins, and a name that is nothing is one line
    (elsewhere / "mine.yaml").write_text("include: model/70m.yaml\n")
    r = subprocess.run(
        [str(venv / "bin" / "megahash"), "params", "--config", "mine.yaml", "--json"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["total"] < installed["total"], r.stderr[-2000:]
    r = subprocess.run(
        [str(venv / "bin" / "megahash"), "params", "--config", "no_such_size"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(elsewhere / "megahash")
