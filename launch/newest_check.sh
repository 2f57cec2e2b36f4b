#!/usr/bin/env bash
# The scheduled check against tomorrow's releases, and the way to refresh the lock.
#
#   bash launch/newest_check.sh                 # fresh venv, newest releases, the whole test suite
#   bash launch/newest_check.sh --write-lock    # ... and, if it passes, rewrite constraints/cpu-lock.txt (and gpu.txt)
#   NEWEST_CHECK_PYTEST="tests/convert/test_convert.py" bash launch/newest_check.sh   # a subset
#
# It installs megahash into a new virtual environment (NEWEST_CHECK_VENV, default
# /tmp/megahash-newest) with only the direct pins of constraints/cpu.txt (torch, megatron-core,
# DeepSpeed, lm-eval), so pip takes the newest release of everything else; prints which packages
# differ from the lock; and runs the suite exactly as .ci/run does. Run it weekly (cron:
# `0 3 * * 1 cd /path/to/megahash && bash launch/newest_check.sh > newest.log 2>&1`) so a
# release that breaks megahash is seen before a user installs it. Exit status: the suite's.
set -euo pipefail
cd "$(dirname "$0")/.."
WRITE=0
for a in "$@"; do
  case "$a" in
    --write-lock) WRITE=1 ;;
    *) echo "error: unknown argument '$a' (use --write-lock or nothing)" >&2; exit 2 ;;
  esac
done
VENV=${NEWEST_CHECK_VENV:-/tmp/megahash-newest}
say() { echo "newest_check: $*"; }
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
say "installing the newest releases allowed by constraints/cpu.txt into $VENV"
MEGAHASH_VENV="$VENV" MEGAHASH_LOCK=constraints/cpu.txt INSTALL_FORCE=1 bash launch/install_cpu.sh
"$PY" -m pip freeze --exclude-editable 2>/dev/null | sed -E 's/^(torch==[^+]*)\+.*/\1/' > "$VENV/freeze.txt"
say "packages that differ from constraints/cpu-lock.txt (< lock, > newest):"
diff <(grep -v '^#' constraints/cpu-lock.txt | sort -f) <(sort -f "$VENV/freeze.txt") | grep '^[<>]' || say "none"
export PATH="$VENV/bin:$PATH"  # deepspeed, torchrun and megahash of the venv for the tests' launches
set +e
# shellcheck disable=SC2086
"$PY" -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --timeout 900 --durations=15 ${NEWEST_CHECK_PYTEST:-tests}
rc=$?
set -e
if [ "$rc" != 0 ]; then
  say "the suite failed on the newest releases (exit $rc): see the diff above for what changed"
  exit "$rc"
fi
if [ "$WRITE" = 1 ]; then
  tmp=constraints/cpu-lock.txt.tmp
  {
    echo "# The tested CPU working set (development, CI): every package of a fresh install, test tools included."
    echo "# launch/install_cpu.sh installs exactly these (pip -c), so a fresh machine runs what CI ran."
    echo "# Refresh: \`bash launch/newest_check.sh --write-lock\` installs the newest releases allowed by"
    echo "# constraints/cpu.txt into a fresh venv, runs the test suite there and, if it passes, rewrites this file."
    echo "# Written from a fresh venv on $(date -u +%Y-%m-%d) ($("$PY" -c 'import platform; print("Python", platform.python_version() + ",", platform.machine())'))."
    cat "$VENV/freeze.txt"
  } > "$tmp"
  mv "$tmp" constraints/cpu-lock.txt
  "$PY" benchmarks/gpu_check.py constraints  # constraints/gpu.txt: the new lock without torch/triton, plus [gpu]
  say "constraints/cpu-lock.txt and constraints/gpu.txt rewritten: commit them"
fi
say "passed"
