"""Shared fixtures: real-text shards built once per session with the data tools, and a runner
for megahash entry points in fresh processes (deepspeed launcher for 2 gloo ranks)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# tests/<package>/ mirrors megahash/<package>/. A test module imports another's helpers by basename
# (``from test_batch_ramp import TINY``); pytest's prepend import mode puts a folder on sys.path only once it
# has collected a file there, so every folder goes on it here, before any test module is imported.
sys.path[1:1] = sorted(str(d) for d in Path(__file__).parent.iterdir() if d.is_dir() and d.name[0] not in "._")


# Scheduling under pytest-xdist (.ci/run: ``-n 3 --dist loadgroup --no-loadscope-reorder``). A unit of work
# is one test; or every test of a module that defines a module- or class-scoped fixture (so the fixture
# is built once); or the ``slurm`` unit (the modules that start the local SLURM: one cluster, session-scoped,
# in one worker). Units go out longest first by the durations measured on the 2-core machine
# (tests/durations.json, written by ``pytest --record-durations tests/durations.json``; a test not in it
# counts DEFAULT_SECONDS), so the workers finish together (longest-processing-time-first).
# The scheduler is xdist's LoadScopeScheduling with megahash's units (pytest_xdist_make_scheduler):
# xdist 3.8's own loadgroup does not group under pytest 9.2 (it renames ``item._nodeid``, which pytest
# 9 no longer reads), so ``xdist_group`` marks would be ignored.
SLURM_MODULES = {"test_slurm", "test_sweep"}
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_SECONDS = 2.0
# The quick tier (``pytest -m quick``): every test measured at most QUICK_SECONDS whose unit (a module
# fixture shared with other tests included) measured at most QUICK_UNIT_SECONDS, none of them slow,
# multi-process, SLURM or GPU. tests/test_quick_tier.py checks its size, time and package coverage.
QUICK_SECONDS = 3.0
QUICK_UNIT_SECONDS = 20.0
NOT_QUICK = ("slow", "multiprocess", "slurm", "gpu")


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        metavar="PATH",
        default=None,
        help="write each test's measured seconds (setup + call + teardown) to PATH as JSON",
    )


@functools.cache
def _shares_a_fixture(module: str) -> bool:
    """``module`` (tests/test_x.py) defines a module- or class-scoped fixture (read from its source)."""
    import ast

    try:
        tree = ast.parse((ROOT / module).read_text())
    except (OSError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and any(
                    k.arg == "scope" and isinstance(k.value, ast.Constant) and k.value.value in ("module", "class")
                    for k in dec.keywords
                ):
                    return True
    return False


def unit_of(nodeid: str) -> str:
    """The xdist work unit of a test id: ``slurm``, its module, or the test itself."""
    module = nodeid.split("::")[0]
    if Path(module).stem in SLURM_MODULES:
        return "slurm"
    return module if _shares_a_fixture(module) else nodeid


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    gpu_skip = None
    if any(item.get_closest_marker("gpu") for item in items):
        from megahash.accelerator import policy

        if not policy.has_gpu():
            gpu_skip = pytest.mark.skip(
                reason="gpu: no CUDA device on this machine (benchmarks/gpu_check.sh runs these on one)"
            )
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    cost: dict[str, float] = {}
    for item in items:
        if gpu_skip is not None and item.get_closest_marker("gpu"):
            item.add_marker(gpu_skip)
        unit = unit_of(item.nodeid)
        cost[unit] = cost.get(unit, 0.0) + measured.get(item.nodeid, DEFAULT_SECONDS)
    for item in items:
        seconds = measured.get(item.nodeid)
        if (
            seconds is not None
            and seconds <= QUICK_SECONDS
            and cost[unit_of(item.nodeid)] <= QUICK_UNIT_SECONDS
            and not any(item.get_closest_marker(m) for m in NOT_QUICK)
        ):
            item.add_marker(pytest.mark.quick)
    items.sort(key=lambda item: -cost[unit_of(item.nodeid)])  # stable: file order within a unit


def _cpu_seconds() -> float:
    """User + system seconds of this process, of every child process it has waited for, and of the commands it
    had the fork server start (tests/_forkserver.py) that have ended."""
    import resource

    import _forkserver

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + _forkserver.forked_cpu_seconds


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Mark the CPU clock before the test's setup (its fixtures count too)."""
    item.user_properties.append(("cpu_start", _cpu_seconds()))
    yield


def pytest_collection_finish(session):
    _freeze_survivors()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """At the end of a test module (its module fixtures torn down), what is still alive is frozen."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        _freeze_survivors()


def _freeze_survivors() -> None:
    """A collection, then ``gc.freeze()``: what survives it (torch, DeepSpeed, megatron-core and the test
    modules, the session's fixtures, lazily imported modules) is left out of every later collection.
    ``process_groups.release_group`` and ``pretrain`` collect in full after each in-process run (to end a
    destroyed gloo group's threads), which over the whole heap of a test process cost ~0.3 s each. Measured
    2026-11-28 on the 2-core machine, quiet, ``-n 2`` over tests/models, test_resume_every_config.py and
    test_ema.py (592 tests): 276-299 CPU-s without, 208-216 with a freeze at each module's end, 312 with one
    at every test (and a full collection at each module's end), so a freeze per module it is. Only objects
    alive at a module's end are frozen, so a run's garbage is still collected within its module."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_runtest_makereport(item, call):
    if call.when == "teardown":
        item.user_properties.append(("cpu_s", _cpu_seconds() - dict(item.user_properties)["cpu_start"]))


class _DurationRecorder:
    """Wall seconds per test (setup + call + teardown) into PATH; CPU seconds into PATH's ``.cpu.json`` twin; and
    where the run's time went into its ``.timeline.json`` twin: each test's worker, start and end (epoch seconds),
    and the machine's busy cores sampled every 2 s from /proc/stat (where the cores idled: waits, the tail)."""

    def __init__(self, path: str):
        import threading

        self.path, self.seconds, self.cpu, self.spans, self.busy = Path(path), {}, {}, {}, []
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        def ticks():
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            return sum(fields), fields[3] + fields[4]  # all, idle + iowait

        try:
            last = ticks()
            while not self._stop.wait(2.0):
                now = ticks()
                total, idle = now[0] - last[0], now[1] - last[1]
                self.busy.append((round(time.time(), 1), round((os.cpu_count() or 1) * (1 - idle / max(total, 1)), 2)))
                last = now
        except OSError:  # no /proc (not Linux): no samples
            pass

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
        start, stop = self.spans.get(report.nodeid, (worker, report.start, report.stop))[1:]
        self.spans[report.nodeid] = (worker, min(start, report.start), max(stop, report.stop))
        cpu = dict(report.user_properties).get("cpu_s")
        if cpu is not None:
            self.cpu[report.nodeid] = cpu

    def pytest_sessionfinish(self, session):
        self._stop.set()
        self.path.write_text(json.dumps({k: round(v, 2) for k, v in sorted(self.seconds.items())}, indent=0) + "\n")
        self.path.with_suffix(".cpu.json").write_text(
            json.dumps({k: round(v, 2) for k, v in sorted(self.cpu.items())}, indent=0) + "\n"
        )
        spans = {
            k: [w, round(a, 2), round(b, 2)] for k, (w, a, b) in sorted(self.spans.items(), key=lambda kv: kv[1][1])
        }
        self.path.with_suffix(".timeline.json").write_text(json.dumps({"tests": spans, "busy_cores": self.busy}) + "\n")


def pytest_configure(config):
    import signal

    # a suite started in the background (``cmd &`` in a script: SIGINT ignored, and inherited) still tests what
    # Ctrl-C does to the commands it starts: a handled signal is back to its default in an exec'd child
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput"):
        # an xdist worker is one of several test streams on the machine's cores: torch's intra-op pool would
        # only oversubscribe them (OpenMP threads spinning against each other), as the launched ranks'
        # OMP_NUM_THREADS=1 (child_env) already avoids
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    if not hasattr(config, "workerinput"):
        _warn_if_the_disk_is_short(config)
    path = config.getoption("--record-durations", default=None)
    if path and not hasattr(config, "workerinput"):  # the controller sees every worker's reports
        config.pluginmanager.register(_DurationRecorder(path), "megahash-durations")


# Peak disk use of a whole run under the temp folder (measured 2026-11-28: 2.0 GB, 1.5 GB of it one data-limits
# test's 192 MiB input and its shards; a passed test's tmp_path is deleted at its teardown, pyproject.toml)
SUITE_PEAK_DISK_GB = 2.5


def _warn_if_the_disk_is_short(config) -> None:
    """One line before any test where the temp folder's disk has less free space than a run's peak: a full disk
    otherwise surfaces as dozens of unrelated tests failing to make their tmp_path (ENOSPC, the CI of 2026-11-28)."""
    import shutil
    import tempfile

    free = shutil.disk_usage(tempfile.gettempdir()).free / 1e9
    if free < SUITE_PEAK_DISK_GB:
        message = (
            f"{free:.1f} GB free under {tempfile.gettempdir()}, a run of the suite needs up to {SUITE_PEAK_DISK_GB} "
            "GB there: tests will fail with 'No space left on device'; free space or point TMPDIR elsewhere"
        )
        print(f"megahash tests: {message}", file=sys.stderr)
        config.issue_config_time_warning(pytest.PytestWarning(message), stacklevel=1)


def doc_block(page: str, heading: str) -> str:
    """The first ```python block after ``heading`` in ``page`` (a docs page's worked example a test runs)."""
    text = (ROOT / page).read_text()
    start = text.index(heading + "\n")
    return text[start:].split("```python\n", 1)[1].split("```", 1)[0]


def config_overrides(path: Path) -> list[str]:
    """The dotted overrides (``a.b=value``) that say what the YAML file ``path`` says."""
    import yaml

    def flat(tree: dict, prefix: str):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}={str(value).lower() if isinstance(value, bool) else value}"

    return list(flat(yaml.safe_load(path.read_text()), ""))


# The tests' tiny runs (tests/_configs/): a test extends one with what it changes (later overrides win)
TINY = config_overrides(ROOT / "tests" / "_configs" / "tiny.yaml")  # 2 layers of width 64, lr 2e-3
TINIER = config_overrides(ROOT / "tests" / "_configs" / "tinier.yaml")  # 1 layer of width 32, ZeRO-0, every step logged
# the in-process model tests' decoder: 2 layers of width 32, 4 heads, sequences of 16 (positions up to 64)
MICRO = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.ffn_hidden_size=64",
    "data.seq_length=16",
    "model.max_position_embeddings=64",
]


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            # the repository first, then what this Python was given (a private site of wheels, as
            # benchmarks/gpu_check.sh installs on a GPU machine, must reach the children too)
            "PYTHONPATH": os.pathsep.join(
                dict.fromkeys([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
            ),
            "WANDB_MODE": "disabled",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
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
    from megahash.accelerator import process_groups

    process_groups.init_distributed(1)
    yield
    process_groups.teardown()


@pytest.fixture(autouse=True)
def _dist_standing(request):
    """A test of a module on ``dist`` finds the world standing even when an in-process run before it (which
    destroys its process group at the end) tore it down: the run order follows tests/durations.json, not the file."""
    if "dist" in request.fixturenames:
        import torch.distributed

        if not torch.distributed.is_initialized():
            from megahash.accelerator import process_groups

            process_groups.init_distributed(1)
    yield


def run(args: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """Run a command from the repository root, capturing output. A Python command is forked from a process that
    has imported the libraries already (tests/_forkserver.py: the same command without ~5 CPU-s of imports)."""
    import _forkserver

    r = _forkserver.run(args, ROOT, child_env(**env), child_env(), timeout)
    if r is not None:
        return r
    return subprocess.run(args, cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def popen(args: list[str], stdout=None, stderr=None, cwd=ROOT, **env):
    """``subprocess.Popen(args, cwd=, env=child_env(**env), stdout=, stderr=, text=True)``; a Python command
    forked from the test fork server (tests/_forkserver.py), with the part of Popen's interface tests use."""
    import _forkserver

    return _forkserver.popen(args, cwd, child_env(**env), child_env(), stdout, stderr)


def local_world(cmd: list[str], ranks: int, timeout: float | None = None, **env) -> list[tuple[int, str]]:
    """``megahash.launching.env.run_local_world`` (the ``env://`` world of ``ranks`` processes of ``cmd``) with
    conftest's child environment, each rank forked from the test fork server: (exit status, output) per rank."""
    from megahash.launching.env import run_local_world

    def start(args, env, stdout, stderr, text):
        return popen(args, stdout, stderr, **env)

    return run_local_world(cmd, ranks, timeout, start=start, env=child_env(**env))


def pretrain(overrides: list[str], ranks: int = 1, config: str | None = None, timeout: int = 600, **env):
    """Launch megahash/pretrain.py on ``ranks`` CPU processes (DeepSpeed launcher for > 1)."""
    cfg = ["--config", config] if config else []
    if ranks == 1:
        cmd = [sys.executable, "megahash/pretrain.py", *cfg, *overrides]
    else:
        port = _free_port()
        cmd = [
            "deepspeed",
            "--num_gpus",
            str(ranks),
            "--master_port",
            str(port),
            "megahash/pretrain.py",
            *cfg,
            *overrides,
        ]
        r = run(cmd, timeout=timeout, **env)
        # DeepSpeed's CPU all-reduce buffers (/dev/shm, 69 MB a rank) must not outlive a finished run
        left = list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert r.returncode != 0 or not left, f"leaked shared memory: {left}"
        return r
    return run(cmd, timeout=timeout, **env)


def pretrain_here(overrides: list[str], config: str | None = None, **env) -> subprocess.CompletedProcess:
    """``pretrain(overrides)`` as one rank in this process (``megahash.pretrain.main``): the same run without a
    fresh interpreter's ~5 CPU-s of imports (see in_process)."""
    from megahash.pretrain import main

    return in_process(main, [*(["--config", config] if config else []), *overrides], **env)


def megahash_here(args: list[str], **env) -> subprocess.CompletedProcess:
    """``megahash ARGS`` (the command-line interface, ``megahash.cli.main``) in this process (see in_process)."""
    from megahash.cli import main

    return in_process(main, list(args), **env)


def in_process(main, argv: list[str], **env) -> subprocess.CompletedProcess:
    """``main(argv)`` of an entry point in this process, as a CompletedProcess: its stdout and stderr captured
    (Python-level, as capsys does), ``env`` set for the call only on top of child_env's fixed variables, an
    exception main lets through a traceback on stderr and status 1, as a process would show them. One intra-op
    thread, as a launched rank (OMP_NUM_THREADS=1), so a run here and a launched one are the same run. An
    in-process run ends with its process group destroyed and its threads gone (tests/test_no_leaks.py)."""
    import contextlib
    import io
    import traceback

    import torch

    fixed = {k: v for k, v in child_env().items() if k in _CHILD_FIXED}
    env = {**fixed, **{k: str(v) for k, v in env.items()}}
    saved_env = {k: os.environ.get(k) for k in env}
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        torch.set_num_threads(threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


_CHILD_FIXED = ("WANDB_MODE", "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")


def pretrain_group(
    runs: list[list[str]], ranks: int = 2, env: list[dict] | None = None, timeout: int = 900
) -> list[subprocess.CompletedProcess]:
    """Several multi-rank pretraining runs, one after another, in one set of ``ranks`` processes
    (tests/_ranks.py calls ``megahash.pretrain.main`` for each: an in-process run ends with its group
    destroyed, so the next starts clean). Each rank gets the DeepSpeed launcher's environment (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_SIZE, CROSS_*, MASTER_ADDR, a free MASTER_PORT per run) and ``--local_rank``, as under
    ``deepspeed --num_gpus N``, without the launcher's two processes; so k runs cost one start-up of ``ranks``
    interpreters instead of k launches (~17 CPU-s each for 2 ranks). For tests of training across ranks; the
    launchers' own behaviour is tested with the real ones (tests/launching/, test_faults.py). ``runs`` are argv
    lists of ``megahash/pretrain.py`` (``--config`` first if any), ``env`` an optional dict per run. Returns one
    CompletedProcess per run: the status of the first rank that failed (else 0), every rank's stdout and stderr
    in rank order."""
    return RankGroup(runs, ranks, env).results(timeout)


class RankGroup:
    """The rank processes of pretrain_group, started at once; ``results`` waits for them (``kill`` stops them)."""

    def __init__(self, runs: list[list[str]], ranks: int = 2, env: list[dict] | None = None, ports=None):
        import tempfile

        env = env or [{} for _ in runs]
        ports = list(ports or [_free_port() for _ in runs])  # a caller with runs of its own binding late names them
        self.tmp = tempfile.TemporaryDirectory(prefix="megahash-ranks-")
        self.dir, self.ranks = Path(self.tmp.name), ranks
        self.spec = [
            {"argv": list(a), "port": port, "env": {k: str(v) for k, v in e.items()}}
            for a, e, port in zip(runs, env, ports)
        ]
        (self.dir / "runs.json").write_text(json.dumps(self.spec))
        self.procs, self.logs = [], []
        for rank in range(ranks):
            launcher = dict(
                RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=ranks, LOCAL_SIZE=ranks, CROSS_RANK=0, CROSS_SIZE=1,
                MASTER_ADDR="127.0.0.1", MASTER_PORT=self.spec[0]["port"],
                CUDA_VISIBLE_DEVICES=",".join(map(str, range(ranks))), PYTORCH_NVML_BASED_CUDA_CHECK=1,
            )  # fmt: skip
            args = [sys.executable, "-u", str(ROOT / "tests" / "_ranks.py"), str(self.dir), f"--local_rank={rank}"]
            log = open(self.dir / f"rank{rank}.log", "w+")  # noqa: SIM115 (read and closed by results)
            self.logs.append(log)
            self.procs.append(popen(args, log, log, **launcher))

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def results(self, timeout: int = 900) -> list[subprocess.CompletedProcess]:
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        finally:
            self.kill()
        logs = []
        for log in self.logs:
            log.seek(0)
            logs.append(log.read())
            log.close()
        results = []
        for i, run_spec in enumerate(self.spec):
            outs, errs, status = [], [], None
            for rank in range(self.ranks):
                outs.append(_read(self.dir / f"{i}.{rank}.out"))
                errs.append(_read(self.dir / f"{i}.{rank}.err"))
                s = _read(self.dir / f"{i}.{rank}.status")
                s = int(s) if s.strip() else None  # None: the rank never finished this run
                if status in (None, 0) and s != 0:
                    status = s if s is not None else 1
            results.append(subprocess.CompletedProcess(run_spec["argv"], status or 0, "".join(outs), "".join(errs)))
        for rank, (p, log) in enumerate(zip(self.procs, logs)):
            if p.returncode != 0:  # a rank that died outside a run's capture: its output on every run
                for r in results:
                    r.stderr += f"\n[rank {rank} exit {p.returncode}]\n{log}"
                    r.returncode = r.returncode or 1
        self.tmp.cleanup()
        left = [f for s in self.spec for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{s['port']}_*")]
        assert not left, f"leaked shared memory: {left}"  # DeepSpeed's CPU all-reduce buffers (69 MB a rank)
        return results


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _free_port() -> int:
    from megahash.launching.env import free_port

    return free_port()


def eager_backend_model(monkeypatch, cfg, vocab: int = 128):
    """A model of ``cfg`` built from seed 0 after dynamo's caches and counters are cleared, ``Module.compile``
    patched to dynamo's eager backend: dynamo's own graph and recompile accounting without inductor's compile
    time (the compile tests count graphs with it)."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megahash.accelerator import rng
    from megahash.models.megatron_model import build_model

    monkeypatch.setattr(torch.nn.Module, "compile", functools.partialmethod(torch.nn.Module.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    rng.seed_all(0)
    return build_model(cfg, vocab, dtype=torch.float32)


def train_losses(run_dir, split: str = "train") -> dict[int, float]:
    """step -> loss of a run's metrics.jsonl (last record of a step wins)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == split:
            out[rec["step"]] = rec["loss"]
    return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> str:
    """A 1,000-piece sentencepiece BPE of 150 Shakespeare documents, trained in process: ``--lossy``, the NFKC
    model whose BPE qualifies for the data stage's per-token segment cache (the lossless default is encoded
    whole; tests/data/test_tokenizers.py covers it). Its ``.model`` path."""
    from megahash.data.preprocess import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    argv = ["--input", "shakespeare", "--output", str(d / "spm"), "--vocab-size", "1000", "--max-docs", "150"]
    assert train_tokenizer.main([*argv, "--quiet", "--lossy"]) == 0
    return str(d / "spm.model")


@pytest.fixture(scope="session")
def shakespeare_shards(tmp_path_factory) -> dict:
    """A sentencepiece BPE model and token shards (md5 + lsh128 side shards) of real Shakespeare
    text, built with the real data tools."""
    d = tmp_path_factory.mktemp("shards")
    spm = d / "spm"
    r = run(
        [
            sys.executable,
            "data_tools/train_tokenizer.py",
            "--input",
            "shakespeare",
            "--output",
            str(spm),
            "--vocab-size",
            "1000",
            "--max-docs",
            "200",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    prefix = d / "shakespeare"
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            f"{spm}.model",
            "--word-hashes",
            "md5,lsh128",
            "--workers",
            "2",
            "--max-docs",
            "400",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {"prefix": str(prefix), "tokenizer": f"{spm}.model", "dir": d}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A real local SLURM (tests/_slurm.py), brought up once per run by the worker of the ``slurm`` group."""
    from _slurm import local_cluster

    yield from local_cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="session")
def hashed_shards(shakespeare_shards, tmp_path_factory):
    """Real-text shards with a side shard for the example hash spec of every embedding kind."""
    import _kinds

    from megahash import catalog

    specs = sorted({catalog.caps("embedding", k).example_hash_spec for k in _kinds.embeddings()} | {"md5", "lsh128"})
    prefix = tmp_path_factory.mktemp("hashed") / "shk"
    r = run(
        [
            sys.executable,
            "data_tools/preprocess_data.py",
            "--input",
            "shakespeare",
            "--output-prefix",
            str(prefix),
            "--tokenizer",
            shakespeare_shards["tokenizer"],
            "--word-hashes",
            ",".join(specs),
            "--workers",
            "1",
            "--max-docs",
            "120",
            "--quiet",
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return {"prefix": str(prefix), "tokenizer": shakespeare_shards["tokenizer"], "specs": specs}


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` (``mount -o size=``: "8m", "900k") mounted at the new folder ``path`` for the body, for
    tests of a full disk; unmounted after it. Skips the test where it cannot mount (not root, no mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    ).returncode:
        pytest.skip("mounting a small tmpfs failed")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
