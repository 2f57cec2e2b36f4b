"""The tests' fork server (tests/_forkserver.py) gives a command what a fresh ``python`` gives it: the same argv,
environment, working directory, ``__main__``, module search path, standard streams and exit status, with no
megahash module imported before the command imports it; and it starts a fresh interpreter where the two could
differ. Each case runs both ways and compares."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import _forkserver
import pytest

from conftest import ROOT, child_env

PROBE = textwrap.dedent(
    """
    import json, os, sys
    first = sorted(m for m in sys.modules if m == "megahash" or m.startswith("megahash."))
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
        "env": {k: os.environ.get(k) for k in ("PROBE_VAR", "OMP_NUM_THREADS", "MASTER_PORT")},
        "env_keys": sorted(os.environ), "megahash_before": first, "stdin": sys.stdin.read(),
    }))
    print("to stderr", file=sys.stderr)
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "exit3":
        sys.exit(3)
    if mode == "message":
        sys.exit("a message")
    if mode == "raise":
        raise ValueError("boom")
    if mode == "kill":
        os.kill(os.getpid(), 9)
    """
)


def _both(args, cwd, env):
    """(fresh, forked) CompletedProcess of ``args``."""
    fresh = subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    forked = _forkserver.run(args, cwd, env, child_env(), timeout=120)
    assert forked is not None, "the fork server was not used"
    return fresh, forked


@pytest.mark.parametrize("mode", ["", "exit3", "message", "raise", "kill"])
def test_a_script_sees_what_a_fresh_interpreter_gives_it(tmp_path, mode):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = child_env(PROBE_VAR="x y", MASTER_PORT=12345)
    fresh, forked = _both([sys.executable, "-u", str(script), mode, "--flag=1"], tmp_path, env)
    assert forked.returncode == fresh.returncode == {"": 0, "exit3": 3, "message": 1, "raise": 1, "kill": -9}[mode]
    assert forked.stdout == fresh.stdout and fresh.stdout.count("\n") == 1, (fresh.stdout, forked.stdout)
    assert forked.stderr.splitlines()[0] == fresh.stderr.splitlines()[0] == "to stderr"
    # the same last line: the SystemExit message, or the traceback's ending (its frames differ: runpy's)
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1], (fresh.stderr, forked.stderr)


def test_a_module_and_the_environment_are_the_fresh_ones(tmp_path):
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(PROBE)
    env = child_env(PROBE_VAR="m")
    fresh, forked = _both([sys.executable, "-m", "probe_pkg", "arg"], tmp_path, env)
    import json

    a, b = json.loads(fresh.stdout), json.loads(forked.stdout)
    assert a == b, (a, b)
    assert a["name"] == "__main__" and a["argv"][1:] == ["arg"] and a["env"]["PROBE_VAR"] == "m"
    assert a["megahash_before"] == [] and a["stdin"] == ""


def test_megahash_is_imported_by_the_command_not_by_the_server(tmp_path):
    """A module the command forgets to import must fail forked as it fails fresh: the server holds no megahash."""
    script = tmp_path / "probe.py"
    script.write_text("import sys; print(sorted(m for m in sys.modules if m.startswith('megahash')))")
    forked = _forkserver.run([sys.executable, str(script)], ROOT, child_env(), child_env())
    assert forked is not None and forked.returncode == 0 and forked.stdout.strip() == "[]", forked
    assert _forkserver.run([sys.executable, "-c", "pass"], ROOT, child_env(), child_env()) is None  # -c: fresh


@pytest.mark.parametrize(
    "args,env",
    [
        (["-X", "importtime", "x.py"], {}),  # an interpreter option
        (["x.py", "--verbose"], {}),  # warnings shown: import-time ones come only from a fresh import
        (["x.py", "logging.verbose=true"], {}),
        (["x.py"], {"OMP_NUM_THREADS": "4"}),  # read when torch is imported
        (["x.py"], {"ATEN_CPU_CAPABILITY": "default"}),
        (["x.py"], {"MEGAHASH_SHOW_WARNINGS": "1"}),
    ],
)
def test_what_an_import_could_see_differently_starts_fresh(args, env):
    assert _forkserver.popen([sys.executable, *args], ROOT, child_env(**env), child_env(), fresh=False) is None


def test_everything_fresh_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGAHASH_TEST_FRESH", "1")
    assert _forkserver.run([sys.executable, str(tmp_path / "x.py")], tmp_path, child_env(), child_env()) is None


def test_kill_reaches_the_child_and_wait_gives_its_signal(tmp_path):
    """Popen's kill on a forked child: the signal goes through the pidfd the server sent with the pid (a recycled pid
    is never signalled), and the status is the signal's, as for a fresh process."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    out = tmp_path / "out.txt"
    with open(out, "w+") as f:
        p = _forkserver.popen([sys.executable, str(script)], tmp_path, child_env(), child_env(), f, f, fresh=False)
        assert p is not None and p.poll() is None
        import time

        deadline = time.monotonic() + 60
        while "up" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.2)
        p.kill()
        assert p.wait(timeout=60) == -9 and p.poll() == -9
        p.kill()  # after the end: nothing is sent, no error


def test_poll_and_wait_when_the_worker_holds_descriptors_above_fd_setsize(tmp_path):
    """A pytest worker that has opened many files gets connection descriptors above 1024 (FD_SETSIZE), which
    ``select.select`` refuses (a CI run failed so): ``poll`` and ``wait`` still work."""
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"RLIMIT_NOFILE is {soft}: no descriptor above 1024 can be opened")
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(300)\n")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        p = _forkserver.popen([sys.executable, str(script)], tmp_path, child_env(), child_env(), fresh=False)
        assert p is not None and p.conn.fileno() > 1024
        assert p.poll() is None
        p.kill()
        assert p.wait(timeout=60) == -9 and p.poll() == -9
    finally:
        for fd in held:
            os.close(fd)


def test_a_changed_import_time_variable_gets_a_server_that_imported_under_it(tmp_path, monkeypatch):
    """An in-process run sets TQDM_DISABLE in the test process (megahash.known_warnings): later commands get a
    server whose imports saw it, not a fresh interpreter each, and not the old server."""
    script = tmp_path / "env.py"
    script.write_text("import os; print(os.environ.get('TQDM_DISABLE'))")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    first = _forkserver.run([sys.executable, str(script)], tmp_path, child_env(), child_env())
    old = _forkserver._server
    monkeypatch.setenv("TQDM_DISABLE", "1")
    second = _forkserver.run([sys.executable, str(script)], tmp_path, child_env(), child_env())
    assert first is not None and second is not None and second.stdout.strip() == "1"
    assert _forkserver._server is not old and _forkserver._server.base_env["TQDM_DISABLE"] == "1"


def test_a_forked_commands_cpu_seconds_are_counted_for_the_test(tmp_path):
    """A forked child is the server's, so its CPU is in no RUSAGE_CHILDREN of the test: the server sends it
    (wait4) with the exit status, and conftest's per-test CPU adds it (tests/durations.cpu.json)."""
    script = tmp_path / "spin.py"
    script.write_text("import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end:\n    pass\n")
    before = _forkserver.forked_cpu_seconds
    forked = _forkserver.run([sys.executable, str(script)], tmp_path, child_env(), child_env(), timeout=120)
    assert forked is not None and forked.returncode == 0
    assert 0.5 <= _forkserver.forked_cpu_seconds - before < 60
