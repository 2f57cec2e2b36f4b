#!/usr/bin/env bash
# The GPU check (issue 43): made on a CPU machine, run once on a bare GPU machine, rehearsed on CPU.
#
#   bash benchmarks/gpu_check.sh --prepare    # CPU machine with PyPI: write .gpu_check/ (git-ignored, <= 60 MiB)
#   bash benchmarks/gpu_check.sh              # the GPU machine (no index, no network), from the repository root
#   bash benchmarks/gpu_check.sh --rehearse   # CPU machine: the same run in a fresh environment of the image's packages
#
# --prepare: every wheel the GPU image lacks (benchmarks/gpu_image.txt) for CPython 3.12 x86-64, at the versions of
#   constraints/gpu.txt (= constraints/cpu-lock.txt without torch/triton, plus the [gpu] extra's fla-core); deepspeed
#   (source only on PyPI) built here into a pure-Python wheel; the quickstart's tokenizer, its token shards
#   (documents 0-1099) and held-out lm-eval tasks. Carry it: the device tool's carry=['.gpu_check'].
# run: pip install --no-index --no-deps --target /tmp/megahash-gpu-site (GPU_CHECK_SITE), a check that every
#   requirement is met, then the parts below in this order (a cut run still says the most), each in its own process
#   group under its own timeout; results rewritten after every part to benchmarks/results/<date>_gpu_check_<gpu>.md
#   and $OUT/ when set; exit non-zero if any part failed, timed out or was not reached.
# --rehearse: prepare, the install step under a bare CPython 3.12 (pyenv's), then the whole run in a fresh venv of
#   this machine's Python holding only the image's packages (CPU builds; PyPI has no CPU torch for 3.12, so the run
#   uses this machine's 3.11 with the torch 2.13.0 CPU wheel and twin wheels of the same pins), up to the CUDA calls.
#
# Budget: 9 minutes (540 s) of command on one H100, installs included. From the H100 run of 2026-11-24
# (../shared/gpu/h100-2026-11-24.md: pip install of this kind of folder ~10 s; python + torch + megatron + deepspeed
# start ~10 s a process; regional compile of a layer ~15-30 s cold; the 500M step ~0.26 s) and this machine's
# rehearsal (tests/durations.json for the CPU twins of the gpu tests):
#   install + doctor              ~30 s   (limit 60; 27 wheels, 26 MiB; the doctor imports every carried module)
#   1 gpu-marked tests           ~150 s   (limit 170: 4 files; test_gpu's compiled engine step and the FlexAttention
#                                          tests compile (~30 s each cold), the bf16 matrix's 13 configurations eager,
#                                          2 in-process runs each ~3 s, shard fixtures ~15 s; 150 s per test at most)
#   2 pretrain sequence          ~110 s   (limit 130: two pretrain.py processes at ~35 s each with compiled layers and
#                                          FlexAttention, 40 steps of the tiny model; eval ~15 s; export ~10 s; compare ~10 s)
#   3 fla vs plain torch          ~35 s   (limit 50: Triton compiles parallel_based fwd+bwd once, ~15 s; three sizes
#                                          timed 5x; a 2-layer approx model twice)
#   4 trainer vs transformers    ~120 s   (limit 140: 500m-4l, seq 2048, micro-batch 8; three workers start in turn:
#                                          megahash compiled ~45 s, transformers eager ~15 s, compiled ~45 s; 3 warm-up
#                                          + 2 rounds x 3 steps a side at ~0.05-0.1 s)
#   sum of limits 550 s, of estimates ~445 s; each part's limit is cut to what is left of the 540 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
  --prepare) shift; exec "$PY" benchmarks/gpu_check.py prepare "$@" ;;
  --rehearse) shift; exec "$PY" benchmarks/gpu_check.py rehearse "$@" ;;
  "" | --*) exec "$PY" benchmarks/gpu_check.py run "$@" ;;
  *) echo "error: unknown argument '$1' (use --prepare, --rehearse or nothing)" >&2; exit 2 ;;
esac
