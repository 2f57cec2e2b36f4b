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
# each capability compiles into an inductor cache of its own, kept between runs (a cold cache cost ~30 CPU-s a
# capability here, 2026-11-28: avx2 119 CPU-s cold, 89 warm): under MEGAHASH_NUMERICS_CACHE (default ~/.cache/megahash/numerics-inductor), one folder per
# capability and host CPU (a home folder can move to a machine with another instruction set), emptied past 1 GiB
caches=${MEGAHASH_NUMERICS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megahash/numerics-inductor}
host=$(grep -E '^(model name|flags|Features)' /proc/cpuinfo 2>/dev/null | sort -u | sha256sum | cut -c1-12)
# the capabilities run side by side (each run is one process, mostly single-threaded), outputs printed in turn
tmp=$(mktemp -d)
pids=()
for cap in "${caps[@]}"; do
  (
    start=$SECONDS
    case "$cap" in default) isa=SSE41 ;; avx2) isa=AVX2 ;; *) isa=ALL ;; esac  # ALL: oneDNN unrestricted
    echo "numerics: ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa (this CPU: $have)"
    # each capability its own inductor cache: a kernel compiled for one ISA and loaded under another (the runs shared
    # /tmp/torchinductor_$USER once) gave NaN and garbage in megatron-core's compiled fusers and FlexAttention
    # and oneDNN held to the same instruction set, as on a CPU that has only it: torch asks oneDNN, not the
    # capability, whether to pack bf16 operands for AMX (cpublas::need_pack), so on an AMX CPU under default/avx2
    # its flash-attention kernel called an AVX-512-only packer ("pack_vnni2 is only supported when avx512 is
    # supported", torch 2.13) in every bf16 SDPA of 512 tokens
    cache="$caches/$host-$cap"
    [ "$(du -sm "$cache" 2>/dev/null | cut -f1)" -gt 1024 ] 2>/dev/null && rm -rf "$cache"
    TORCHINDUCTOR_CACHE_DIR="$cache" ATEN_CPU_CAPABILITY=$cap ONEDNN_MAX_CPU_ISA=$isa OMP_NUM_THREADS=1 python3 -m pytest -q -m "numerics and not multiprocess and not slow" \
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
