#!/usr/bin/env bash
# megahash: the 70M decoder of [Xue25] Table 4.10 with standard attention (uniform:mha) and the 500M
# run's Table 4.9 recipe (configs/pretrain_500m_hybrid.yaml hyperparameters, 15B tokens, ZeRO-1, bf16).
# Uses configs/pretrain_70m.yaml if it exists, else writes SAVE_DIR/slurm_recipe_70m.yaml (an include of
# the 500M recipe and configs/model/70m.yaml). Same variables, overrides, signal/requeue protocol as
# slurm/pretrain_500m_hybrid.sh:
#   sbatch slurm/pretrain_70m.sh [key=value ...]
#   CONFIG SAVE_DIR (runs/pretrain_70m) DATA_PREFIX TOKENIZER STEPS MICRO_BATCH GLOBAL_BATCH SCHEDULE ZERO_STAGE
#   PRECISION TP SAVE_INTERVAL RESUME NODES GPUS_PER_NODE LAUNCHER REQUEUE PYTHON MEGAHASH_ROOT
#SBATCH --job-name=megahash-70m
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
MH_SCRIPT=slurm/pretrain_70m.sh
MH_SIZE=70m
: "${SAVE_DIR:=runs/pretrain_70m}"
MH_ROOT=${MEGAHASH_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
[ -f "$MH_ROOT/slurm/_common.sh" ] || MH_ROOT=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/..
[ -f "$MH_ROOT/slurm/_common.sh" ] || { echo "error: no megahash checkout at $MH_ROOT: submit from the repository root or set MEGAHASH_ROOT" >&2; exit 2; }
source "$MH_ROOT/slurm/_common.sh"
mh_pretrain "$@"
