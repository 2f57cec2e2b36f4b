#!/usr/bin/env bash
# The GPU check (issue 43): made on a CPU machine, run once on a bare GPU machine, rehearsed on CPU.
#
#   bash benchmarks/gpu_check.sh --prepare    # CPU machine with PyPI: write .gpu_check/ (git-ignored, <= 60 MiB)
#   bash benchmarks/gpu_check.sh              # the GPU machine (no index, no network), from the repository root
#   bash benchmarks/gpu_check.sh --parts tests --tests 'levers or fla_path'   # a rerun of some parts or tests
#   bash benchmarks/gpu_check.sh --rehearse   # CPU machine: the same run in a fresh environment of the image's packages
#
# --prepare: every wheel the GPU image lacks (benchmarks/gpu_image.txt) for CPython 3.12 x86-64, at the versions of
#   constraints/gpu.txt (= constraints/cpu-lock.txt without torch/triton, plus the [gpu] extra's fla-core); deepspeed
#   (source only on PyPI) built here into a pure-Python wheel; the quickstart's tokenizer, its token shards
#   (documents 0-1099) and held-out lm-eval tasks. Carry it: the device tool's carry=['.gpu_check'].
# run: pip install --no-index --no-deps --target /tmp/megahash-gpu-site (GPU_CHECK_SITE) and the bytecode compiled on all
#   cores, a check that every requirement is met (package metadata), then the parts below in this order, each in its own
#   process group under its own timeout, all sharing one Triton and one inductor cache (a kernel compiled by one part is
#   not compiled again by the next); results rewritten after every part to benchmarks/results/<date>_gpu_check_<gpu>.md
#   and $OUT/ when set (each part's log too, named <n>_<key>.log); exit non-zero if any part failed, timed out or was
#   not reached. `--matrix all` runs the bf16 matrix's embedding- and head-only configurations on CUDA too.
# --rehearse: prepare, the install step under a bare CPython 3.12 (pyenv's), then the whole run in a fresh venv of
#   this machine's Python holding only the image's packages (CPU builds; PyPI has no CPU torch for 3.12, so the run
#   uses this machine's 3.11 with the torch 2.13.0 CPU wheel and twin wheels of the same pins), up to the CUDA calls.
#
# Budget: 570 s of command on one H100 or H200, installs included (the device tool allows 600 s a command and 900 s a
# session; the H200's start took about 30 s, so a whole run leaves time to start one more machine for a rerun of what
# failed: --parts tests --tests 'EXPR'). Measured on a bare H200 on 2026-11-30 (torch 2.11.0+cu130, Triton 3.6.0,
# Python 3.12.3, 16 cores; benchmarks/results/2026-11-30_gpu_check_NVIDIA-H200.md, 473 s at a 540 s budget, and its
# _rerun file): install and doctor 12 s; the tests part's 13 tests before the matrix's 4th took 155 s (pytest's start
# and fla's configs 25, test_gpu.py's 5 23, test_ops' fla test 2.5, the 4 packed rows 24.5, the gated delta rule's
# 2 9, three matrix configurations 27-28 each), then it was cut; in the rerun, cold, the levers configuration 38 s,
# objective-mlm 72 s; pretrain.py steps 1-20 58 s, its resume 37 s, lm-eval beside the export 42 s; the fla part 39 s;
# the benchmark 78 s. Hence (seconds):
#
#   part                        limit estimate measured (H200)
#   install + doctor + probe      20     15      12
#   1 gpu-marked tests           245    240   cut at 186 in the matrix (155 s for the 13 before it, ~28 s a matrix
#                                                configuration with warm caches; the 20-layer decoder last, unmeasured)
#   2 pretrain sequence          150    145     143
#   3 fla vs plain torch          45     40      39
#   4 trainer vs transformers     90     80      78
#
#   With the install's 20 first and every part run to its full limit and killed (3 s of SIGTERM grace each), the last
#   part starts at 469 s and ends by 559 s, within the 570 less a 5 s margin (tests/test_gpu_check.py checks it).
#   Each part is told its deadline (GPU_CHECK_DEADLINE): the tests part's plugin (benchmarks/gpu_check_pytest.py)
#   gives each test at most 120 s and at most what is left, prints each outcome as the test ends and reports the
#   tests it could not start, so a cut run still says which tests passed, how long each took and why one failed.
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
