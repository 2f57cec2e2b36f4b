# Sourced (not run) by launch/install_cpu.sh, launch/quickstart.sh and .ci/run, from the repository root:
# the Python environment megahash is installed into and run from.
#   VENV = MEGAHASH_VENV if set, else the active virtual environment (VIRTUAL_ENV), else .venv here;
#   MEGAHASH_VENV=none: the current Python (PYTHON, default python3), no virtual environment.
# use_venv puts VENV's bin/ first on PATH (what `source VENV/bin/activate` does, without the prompt),
# so python3, pip, deepspeed, torchrun and megahash are the environment's; PATH is left as it is
# when its python3 already is the environment's (an activated venv, or tests' shims in front of it).
VENV=${MEGAHASH_VENV:-${VIRTUAL_ENV:-$PWD/.venv}}
use_venv() {
  if [ "$VENV" != none ] && ! [ "$(command -v python3)" -ef "$VENV/bin/python3" ]; then
    export VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH"
  fi
}
