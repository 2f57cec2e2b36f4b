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
mapfile -t files < <(grep -rl --include="test_*.py" "mark\.numerics" tests)
# the capabilities run side by side (each run is one process, mostly single-threaded), outputs printed in turn
tmp=$(mktemp -d)
pids=()
for cap in "${caps[@]}"; do
  (
    start=$SECONDS
    echo "numerics: ATEN_CPU_CAPABILITY=$cap (this CPU: $have)"
    # each capability its own inductor cache: a kernel compiled for one ISA and loaded under another (the runs share
    # /tmp/torchinductor_$USER otherwise) gave NaN and garbage in megatron-core's compiled fusers and FlexAttention
    TORCHINDUCTOR_CACHE_DIR="$tmp/inductor-$cap" ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=1 python3 -m pytest -q -m "numerics and not multiprocess and not slow" \
      -p no:cacheprovider "${files[@]}" "$@"
    rc=$?
    echo "numerics: ATEN_CPU_CAPABILITY=$cap took $((SECONDS - start)) s"
    exit $rc
  ) >"$tmp/$cap.log" 2>&1 &
  pids+=($!)
done
status=0
for i in "${!caps[@]}"; do
  wait "${pids[$i]}" || status=1
  cat "$tmp/${caps[$i]}.log"
done
rm -rf "$tmp"
exit $status
