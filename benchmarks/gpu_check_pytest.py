"""The GPU check's pytest plugin (``pytest -p gpu_check_pytest``, with ``benchmarks/`` on ``sys.path``;
``benchmarks/gpu_check.py``'s tests part loads it): one line per test the moment it ends, so that a part killed by
its limit still records which tests passed, how long each took and why one failed.

Each line starts with :data:`MARK`:

    gpu_check-test: queued tests/x.py::t                      (collection: the order they will run in)
    gpu_check-test: NOT RUN by design tests/x.py::t: REASON   (deselected here; GPU_CHECK_MATRIX=all runs them)
    gpu_check-test: start +12.3 s tests/x.py::t               (seconds since the session started)
    gpu_check-test: PASSED 4.1 s tests/x.py::t
    gpu_check-test: FAILED 4.1 s tests/x.py::t                (ERROR: in setup or teardown), then up to
    gpu_check-test:   | E   AssertionError: ...               the exception lines and the last frames
    gpu_check-test: TIMEOUT 60.0 s tests/x.py::t: pytest-timeout's 60 s   (then where it was)
    gpu_check-test: NOT REACHED tests/x.py::t: ...            (the part's time was spent before it started)

The order (:func:`order_key`): the cheap, never-yet-run CUDA tests first, the bf16 matrix last, its largest
configurations (every attention kind, fla's among them) at its end. Each test's pytest-timeout is at most what
is left of the part's time (``GPU_CHECK_DEADLINE``, epoch seconds, set by the runner, less
:data:`END_MARGIN_S` for the session's end), so a test cut by the part's end reports as the timeout it is, with
its traceback, and the session still ends with its summary; a test that cannot start is reported not reached.
Where the run turned on fla's switch that skips autotuning (``FLA_CACHE_MODE=default``), it first writes the
configs fla then reads (``gpu_check.write_fla_configs``). Standard library and pytest only at import."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

MARK = "gpu_check-test:"
END_MARGIN_S = 10.0  # the part's last seconds: module teardowns and pytest's summary
MIN_TEST_S = 10.0  # a test with less left than this is not started
TIMEOUT_RE = re.compile(r"Timeout \(>([0-9.]+)s\) from pytest-timeout")
NOT_REACHED = "gpu_check: not reached"
# the files with gpu tests, in the order they run; a file not named here runs before the matrix
FILE_ORDER = (
    "tests/test_gpu.py",
    "tests/ops/test_ops.py",
    "tests/models/test_packed_documents.py",
    "tests/ops/test_gated_delta.py",
)
MATRIX_FILE = "tests/training/test_bf16.py"
MATRIX_TEST = "test_bf16_matrix_on_cuda"
BY_DESIGN = (
    "it varies only the embedding or the head: device-independent torch under kinds this run covers "
    "(the suite runs it on CPU; --matrix all runs it here)"
)


def overrides_value(overrides: list[str], key: str) -> str | None:
    """The value ``overrides`` (``a.b=c`` strings) give ``key``, or None."""
    for o in overrides:
        k, _, v = o.partition("=")
        if k == key:
            return v
    return None


def matrix_on_cuda(overrides: list[str]) -> bool:
    """Whether a bf16-matrix configuration runs on CUDA by default: those that choose attention kinds (a
    ``model.schedule``: every kind, decoders and encoders) do; those that vary only the embedding or the head
    do not (:data:`BY_DESIGN`)."""
    return overrides_value(overrides, "model.schedule") is not None


def order_key(nodeid: str, overrides: list[str] | None) -> tuple:
    """Sort key of a test: its file's place (:data:`FILE_ORDER`, other files next, the matrix last), then, in the
    matrix, its configuration's layer count, an encoder before a decoder of as many layers: last the decoder of
    every causal kind, whose CUDA paths include fla's kernels (Triton compiles on first use)."""
    path = nodeid.split("::")[0]
    if path == MATRIX_FILE and overrides is not None:
        layers = int(overrides_value(overrides, "model.num_layers") or 1)
        return (len(FILE_ORDER) + 1, layers, overrides_value(overrides, "model.arch") != "encoder")
    rank = FILE_ORDER.index(path) if path in FILE_ORDER else len(FILE_ORDER)
    return (rank, 0, False)


def _matrix_overrides(item) -> list[str] | None:
    if item.nodeid.split("::")[0] != MATRIX_FILE or getattr(item, "originalname", "") != MATRIX_TEST:
        return None
    name = item.callspec.params.get("name")
    return list(getattr(item.module, "CONFIGS", {}).get(name, []))


def tail(text: str, frames: int = 3, errors: int = 4) -> list[str]:
    """The exception lines (``E   ...``, the last ``errors``) and the last ``frames`` locations (``path:line:``)
    of a pytest failure's text."""
    lines = text.splitlines()
    locs = [x.strip() for x in lines if re.match(r"^\S[^:\s]*\.py:\d+:", x)]
    errs = [x.rstrip()[:240] for x in lines if x.startswith("E ")]
    return locs[-frames:] + errs[-errors:]


class Reporter:
    """The plugin's state: when the session started, each test's reports so far."""

    def __init__(self, config):
        self.config, self.t0, self.reports = config, time.time(), {}
        deadline = os.environ.get("GPU_CHECK_DEADLINE")
        self.deadline = float(deadline) - END_MARGIN_S if deadline else None
        self.everything = os.environ.get("GPU_CHECK_MATRIX", "") == "all"

    def say(self, text: str) -> None:
        """One line of its own (after the progress characters pytest may have left on the current line)."""
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        tw = getattr(tr, "_tw", None)
        if tw is None:
            print(f"{MARK} {text}", flush=True)
            return
        if tw.width_of_current_line:
            tw.line()
        tw.line(f"{MARK} {text}")
        tw.flush()

    @pytest.hookimpl(trylast=True)  # after tests/conftest.py's own ordering
    def pytest_collection_modifyitems(self, session, config, items):
        keep, dropped = [], []
        for item in items:
            ov = _matrix_overrides(item)
            if ov is not None and not self.everything and not matrix_on_cuda(ov):
                dropped.append(item)
            else:
                keep.append(item)
        keep.sort(key=lambda it: order_key(it.nodeid, _matrix_overrides(it)))  # stable: file order otherwise
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        for item in dropped:
            self.say(f"NOT RUN by design {item.nodeid}: {BY_DESIGN}")
        for item in keep:
            self.say(f"queued {item.nodeid}")

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)  # before pytest-timeout reads the marker
    def pytest_runtest_protocol(self, item, nextitem):
        if self.deadline is not None:
            left = self.deadline - time.time()
            if left < MIN_TEST_S:
                item.add_marker(pytest.mark.skip(reason=f"{NOT_REACHED}: {max(left, 0):.0f} s of the part left"))
            else:
                own = item.get_closest_marker("timeout")
                cap = (own.args[0] if own.args else own.kwargs.get("timeout")) if own is not None else None
                cap = cap or item.config.getoption("timeout", default=None) or left
                item.add_marker(pytest.mark.timeout(round(min(float(cap), left), 1)), append=False)
        self.say(f"start +{time.time() - self.t0:.1f} s {item.nodeid}")
        yield

    def pytest_runtest_logreport(self, report):
        self.reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        reports = self.reports.pop(nodeid, [])
        seconds = sum(r.duration for r in reports)
        bad = [r for r in reports if r.failed]
        skipped = [r for r in reports if r.skipped]
        if bad:
            r = bad[0]
            text = r.longreprtext
            timeout = TIMEOUT_RE.search(text)
            if timeout:
                self.say(f"TIMEOUT {seconds:.1f} s {nodeid}: pytest-timeout's {float(timeout.group(1)):.0f} s")
                self._teardown_after_timeout()
            else:
                self.say(f"{'FAILED' if r.when == 'call' else 'ERROR'} {seconds:.1f} s {nodeid}")
            for line in tail(text):
                self.say(f"  | {line}")
        elif skipped:
            r = skipped[0]
            reason = r.longrepr[2] if isinstance(r.longrepr, tuple) else str(r.longrepr)
            reason = reason.removeprefix("Skipped: ")
            if hasattr(r, "wasxfail"):
                self.say(f"XFAIL {seconds:.1f} s {nodeid}: {r.wasxfail}")
            elif reason.startswith(NOT_REACHED):
                self.say(f"NOT REACHED {nodeid}: {reason}")
            else:
                self.say(f"SKIPPED {seconds:.1f} s {nodeid}: {reason}")
        else:
            xpass = any(hasattr(r, "wasxfail") for r in reports)
            self.say(f"{'XPASS' if xpass else 'PASSED'} {seconds:.1f} s {nodeid}")

    @staticmethod
    def _teardown_after_timeout() -> None:
        """A timed-out test's own cleanup did not run: megahash's one-rank process group, if the test left one,
        is torn down so that the next test starts clean."""
        groups = sys.modules.get("megahash.accelerator.process_groups")
        if groups is not None:
            try:
                groups.teardown()
            except Exception:
                pass


def pytest_configure(config):
    config.pluginmanager.register(Reporter(config), "gpu-check-reporter")
    if os.environ.get("FLA_CACHE_MODE") == "default" and os.environ.get("FLA_CONFIG_DIR"):
        import gpu_check  # beside this file: fla's switch that skips autotuning, before any test imports fla

        line = gpu_check.fla_configs_for_the_run()
        if line:
            print(f"gpu_check: {line}", flush=True)
