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
# Budget: 9 minutes (540 s) of command on one H100, installs included. What is measured: the H100 run of 2026-11-24
# (../shared/gpu/h100-2026-11-24.md): the 500M step 0.26 s (63K tokens/s), compiled layers 1.4x eager; on this 2-core
# machine: the install of the 29 wheels 13 s (quiet) to 52 s (load 20), the doctor ~10 s. What is estimated (no GPU
# timing of it exists yet): a python + torch + megatron-core + DeepSpeed start ~10 s a process, a cold regional compile
# of a layer 15-30 s, Triton's first compile of a kernel 10-20 s. Hence, in this order:
#   install + doctor              ~30 s   (ahead of the parts, within the 540 s)
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
#   the parts' limits sum to 490 s, 520 s with the install (estimates: ~445 s); each limit is also cut to what is left
#   of the 540 s, and the results file is rewritten after every part, so a cut loses at most the part that was running.
# Without CUDA (the rehearsal) each limit is multiplied by --cpu-scale (12).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-}" in
  --prepare) shift; exec "$PY" benchmarks/gpu_check.py prepare "$@" ;;
  --rehearse) shift; exec "$PY" benchmarks/gpu_check.py rehearse "$@" ;;
  "" | --*) exec "$PY" benchmarks/gpu_check.py run "$@" ;;
  *) echo "error: unknown argument '$1' (use --prepare, --rehearse or nothing)" >&2; exit 2 ;;
esac
