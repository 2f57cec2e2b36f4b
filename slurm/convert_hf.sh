#!/usr/bin/env bash
# megahash: export a checkpoint to a Hugging Face model folder (python -m megahash export-hf).
#
#   CHECKPOINT=runs/pretrain_500m_hybrid/step_00028610 OUTPUT=hf/megahash-500m-hybrid sbatch slurm/convert_hf.sh
#
# Environment: CHECKPOINT (adds --checkpoint), OUTPUT (adds --output), PYTHON (python3),
# MEGAHASH_ROOT (the submit directory). Trailing arguments go to `python -m megahash export-hf`.
#SBATCH --job-name=megahash-export-hf
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
MH_SCRIPT=slurm/convert_hf.sh
MH_ROOT=${MEGAHASH_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
[ -f "$MH_ROOT/slurm/_common.sh" ] || MH_ROOT=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/..
[ -f "$MH_ROOT/slurm/_common.sh" ] || { echo "error: no megahash checkout at $MH_ROOT: submit from the repository root or set MEGAHASH_ROOT" >&2; exit 2; }
source "$MH_ROOT/slurm/_common.sh"
mh_single export-hf ${CHECKPOINT:+--checkpoint "$CHECKPOINT"} ${OUTPUT:+--output "$OUTPUT"} "$@"
