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
# Budget: 9 minutes (540 s) of command on one H100, installs included. Measured on a bare H100 on 2026-11-28 (torch
# 2.11.0+cu130, Python 3.12.3, 16 cores; benchmarks/results/2026-11-28_gpu_check_NVIDIA-H100-80GB-HBM3.md and its
# second call): the install 4.5 s; the doctor's import of the 29 carried modules with the probe 47.5 s; the first bf16
# matrix test alone > 101.6 s, still in Triton's first compile of fla's parallel_based_fwd_kernel; tests/test_gpu.py's
# 5 tests and test_ops' fla test passed within ~60 s together (pytest's start included); test_gated_delta's fla test
# still autotuning fla's gated-delta kernels when 95 s ran out; pretrain.py steps 1-20 75.7 s, its resume 41.9 s,
# then lm-eval cut by the 130 s (the CPU rehearsal took 99 s for it at 20 documents a task); the fla part 46 s; the
# benchmark 111 s. Hence (seconds; the estimates are the measured figures where a step ran to its end, else guesses):
#
#   part                        limit estimate measured      what the estimate holds
#   install + doctor + probe      25     20      52          install 4.5; requirements from the metadata ~1 (the
#                                                            29-module import check runs only at the end of a failed
#                                                            run: the parts import those modules anyway); bytecode on
#                                                            16 cores ~2; the probe imports torch alone ~10
#   1 gpu-marked tests           190    185   cut at 170     pytest's start 15; test_gpu.py's 5 + test_ops' fla 40;
#                                                            the 4 packed-row tests 25 (2 FlexAttention compiles);
#                                                            test_gated_delta's 2: 25 (fla's 9 kernels, one config
#                                                            each: FLA_CACHE_MODE=default, not 52 autotuned); the bf16
#                                                            matrix's 6 configurations that choose attention kinds:
#                                                            4 small 20, the 20-layer encoder 15, the 20-layer decoder
#                                                            last 45 (fla's kernels at its shapes); the 8 that vary only
#                                                            the embedding or the head not run by design
#   2 pretrain sequence          150    140   cut at 130     steps 1-20 76 and resume 42 (measured), then lm-eval on the
#                                                            EMA weights, 5 documents a task, ~20, beside export-hf ~10
#                                                            and the logits' comparison ~8
#   3 fla vs plain torch          55     46      46          as measured
#   4 trainer vs transformers    105     96     111          the two transformers sides now start together after
#                                                            megahash's (-15: the eager side's start and warm-up)
#
#   With the install's 25 first and every part run to its full limit and killed (3 s of SIGTERM grace each), the last
#   part starts at 429 s and ends by 534 s, within the 540 less a 5 s margin (tests/test_gpu_check.py checks it).
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
