#!/usr/bin/env bash
# Re-runs the in-process numerical tests (pytest marker `numerics`, without the multiprocess/slow ones)
# under ATen's portable CPU kernels (ATEN_CPU_CAPABILITY=default) and, on a CPU with AVX-512, under
# avx2 as well: a test that asserts bit-equality of floating-point results that another instruction set
# rounds differently fails here, not on a user's machine (issue 36). Exits non-zero if any run fails.
# Extra arguments go to pytest (e.g. -x, -n 2). Called by .ci/run after the main suite.
set -u
cd "$(dirname "$0")/.."
have=$(python3 -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
caps=(default)
case "$have" in AVX512*) caps+=(avx2) ;; esac
# only the files that carry the marker: collecting all of tests/ imports every module (~10 s a run here)
mapfile -t files < <(grep -l "mark\.numerics" tests/test_*.py)
status=0
for cap in "${caps[@]}"; do
  echo "numerics: ATEN_CPU_CAPABILITY=$cap (this CPU: $have)"
  start=$SECONDS
  ATEN_CPU_CAPABILITY=$cap python3 -m pytest -q -m "numerics and not multiprocess and not slow" -p no:cacheprovider \
    "${files[@]}" "$@" || status=1
  echo "numerics: ATEN_CPU_CAPABILITY=$cap took $((SECONDS - start)) s"
done
exit $status
