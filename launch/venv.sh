# Sourced (not run) by launch/install_cpu.sh, launch/quickstart.sh and .ci/run, from the repository root:
# the Python environment megahash is installed into and run from.
#   VENV = MEGAHASH_VENV if set, else the active virtual environment (VIRTUAL_ENV), else .venv here;
#   MEGAHASH_VENV=none: the current Python (PYTHON, default python3), no virtual environment.
# use_venv puts VENV's bin/ first on PATH (what `source VENV/bin/activate` does, without the prompt),
# so python3, pip, deepspeed, torchrun and megahash are the environment's; PATH is left as it is
# when its python3 already is the environment's (an activated venv, or tests' shims in front of it).
# (Folders are compared, not the python3 files: a venv's python3 is a link to the base interpreter.)
VENV=${MEGAHASH_VENV:-${VIRTUAL_ENV:-$PWD/.venv}}
_venv_dir() { (cd "$1" 2>/dev/null && pwd -P); }
use_venv() {
  local on_path
  on_path=$(command -v python3 || true)
  if [ "$VENV" != none ] && [ "$(_venv_dir "${on_path%/*}")" != "$(_venv_dir "$VENV/bin")" ]; then
    export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
  fi
}
