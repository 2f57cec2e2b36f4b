#!/usr/bin/env bash
# megahash: one cell of a `megahash sweep` grid per SLURM array task (submitted by
# `megahash sweep --grid GRID.yaml --launcher slurm`, which writes SWEEP_DIR/cells.txt and every
# cell's resolved config SWEEP_DIR/cells/CELL/cell_config.yaml first).
#
# Task i trains cell i (line i+1 of cells.txt) exactly like the other megahash SLURM scripts
# (slurm/_common.sh: SAVE_DIR = the cell directory, train.resume=auto, SIGUSR1 -> every rank
# checkpoints -> exit 3 -> scontrol requeue -> the requeued task resumes), then evaluates it on the
# grid's tasks and marks it done (python -m megahash sweep --finish-cell CELL --out SWEEP_DIR). A
# task whose cell is already done exits 0 at once, so resubmitting the array only runs what is left.
#
#   SWEEP_DIR=runs/grids/NAME sbatch --array=0-N-1 slurm/sweep_array.sh [key=value ...]
#   Environment: SWEEP_DIR (required), LAUNCHER, NODES, GPUS_PER_NODE, REQUEUE, PYTHON, MEGAHASH_ROOT
#   as in slurm/_common.sh. Resources per task come from the header or sbatch options
#   (the grid's slurm.sbatch list and `megahash sweep --sbatch=...`).
#SBATCH --job-name=megahash-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out
MH_SCRIPT=slurm/sweep_array.sh
MH_ROOT=${MEGAHASH_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
[ -f "$MH_ROOT/slurm/_common.sh" ] || MH_ROOT=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/..
[ -f "$MH_ROOT/slurm/_common.sh" ] || { echo "error: no megahash checkout at $MH_ROOT: submit from the repository root or set MEGAHASH_ROOT" >&2; exit 2; }
source "$MH_ROOT/slurm/_common.sh"
mh_require_slurm "sweeps without SLURM: megahash sweep --grid GRID.yaml --launcher local"
[ -n "${SWEEP_DIR:-}" ] || mh_fail "SWEEP_DIR is not set: submit with 'megahash sweep --grid GRID.yaml --launcher slurm'"
[ -n "${SLURM_ARRAY_TASK_ID:-}" ] || mh_fail "$MH_SCRIPT is a job array: submit with sbatch --array=0-N-1 (megahash sweep does)"
[ -f "$SWEEP_DIR/cells.txt" ] || mh_fail "$SWEEP_DIR/cells.txt does not exist: submit with 'megahash sweep --grid GRID.yaml --launcher slurm'"
MH_CELL=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$SWEEP_DIR/cells.txt")
[ -n "$MH_CELL" ] || mh_fail "array index $SLURM_ARRAY_TASK_ID has no cell in $SWEEP_DIR/cells.txt"
SAVE_DIR="$SWEEP_DIR/cells/$MH_CELL"
CONFIG="$SAVE_DIR/cell_config.yaml"
if [ -f "$SAVE_DIR/sweep_cell.json" ]; then
  mh_log "cell $MH_CELL (array task $SLURM_ARRAY_TASK_ID) is already done; nothing to do"
  exit 0
fi
mh_after_pretrain() {
  mh_log "cell $MH_CELL trained; evaluating"
  "${PYTHON:-python3}" -m megahash sweep --finish-cell "$MH_CELL" --out "$SWEEP_DIR"
}
mh_log "array task $SLURM_ARRAY_TASK_ID: cell $MH_CELL"
mh_pretrain "$@"
