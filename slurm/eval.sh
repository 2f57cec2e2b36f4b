#!/usr/bin/env bash
# megahash: evaluate a checkpoint on one GPU (python -m megahash eval, lm-eval-harness adapter).
#
#   CHECKPOINT=runs/pretrain_500m_hybrid/step_00028610 sbatch slurm/eval.sh [--tasks hellaswag,piqa ...]
#   sbatch slurm/eval.sh --checkpoint runs/pretrain_500m_hybrid/step_00028610 --tasks lambada_openai
#
# Environment: CHECKPOINT (adds --checkpoint; a run directory means its newest checkpoint, as the
# eval subcommand decides), TASKS (adds --tasks), OUTPUT (adds --out: the results JSON), PYTHON (python3),
# MEGAHASH_ROOT (the submit directory). Trailing arguments go to `python -m megahash eval` unchanged.
#SBATCH --job-name=megahash-eval
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
MH_SCRIPT=slurm/eval.sh
MH_ROOT=${MEGAHASH_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
[ -f "$MH_ROOT/slurm/_common.sh" ] || MH_ROOT=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/..
[ -f "$MH_ROOT/slurm/_common.sh" ] || { echo "error: no megahash checkout at $MH_ROOT: submit from the repository root or set MEGAHASH_ROOT" >&2; exit 2; }
source "$MH_ROOT/slurm/_common.sh"
mh_single eval ${CHECKPOINT:+--checkpoint "$CHECKPOINT"} ${TASKS:+--tasks "$TASKS"} ${OUTPUT:+--out "$OUTPUT"} "$@"
