#!/usr/bin/env bash
# megahash: the [Xue25] 500M hybrid decoder (configs/pretrain_500m_hybrid.yaml: Table 4.10 size,
# Table 4.9 hyperparameters, schedule hybrid:rndembqk:even = RndEmbQK in odd layers, standard
# attention in even layers, 15B tokens = 28,610 steps of 256 x 2048, ZeRO-1, bf16), multi-node.
#
#   sbatch slurm/pretrain_500m_hybrid.sh                                     # submit from the repo root
#   DATA_PREFIX=/data/pile/pile TOKENIZER=/data/pythia.model sbatch slurm/pretrain_500m_hybrid.sh
#   sbatch --nodes=8 slurm/pretrain_500m_hybrid.sh train.micro_batch_size=4  # trailing key=value overrides
#
# One srun task per GPU runs megahash/pretrain.py (python -m launch --launcher srun); ranks map
# SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, MASTER_ADDR = first node, MASTER_PORT = 20000 + job id % 20000.
#
# Signals and requeue: 120 s before the time limit SLURM sends SIGUSR1 to this batch shell
# (--signal=B:USR1@120); the shell forwards it to srun, which forwards it to every rank; the ranks
# checkpoint at the next step boundary and exit 3; the shell then runs `scontrol requeue`, and the
# requeued job resumes from the newest complete checkpoint (train.resume=auto). Send it yourself
# with `scancel --signal=USR1 --batch JOBID` (or to the ranks: `scancel --signal=USR1 JOBID`).
# Any other exit status ends the job with that status (2: bad input, one line `error: ...`).
#
# Environment variables (override the config; trailing key=value arguments override everything):
#   CONFIG (configs/pretrain_500m_hybrid.yaml)  SAVE_DIR (runs/pretrain_500m_hybrid)  DATA_PREFIX
#   TOKENIZER  STEPS  MICRO_BATCH  GLOBAL_BATCH  SCHEDULE  ZERO_STAGE  PRECISION  TP  SAVE_INTERVAL
#   RESUME (auto)  NODES / GPUS_PER_NODE (expected allocation, checked)  LAUNCHER (srun)  REQUEUE (1)
#   PYTHON (python3)  MEGAHASH_ROOT (the submit directory). Details: slurm/_common.sh, docs/launching.md.
#SBATCH --job-name=megahash-500m-hybrid
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
MH_SCRIPT=slurm/pretrain_500m_hybrid.sh
: "${CONFIG:=configs/pretrain_500m_hybrid.yaml}" "${SAVE_DIR:=runs/pretrain_500m_hybrid}"
MH_ROOT=${MEGAHASH_ROOT:-${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}}
[ -f "$MH_ROOT/slurm/_common.sh" ] || MH_ROOT=$(dirname "$(scontrol show job "${SLURM_JOB_ID:-0}" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p')")/..
[ -f "$MH_ROOT/slurm/_common.sh" ] || { echo "error: no megahash checkout at $MH_ROOT: submit from the repository root or set MEGAHASH_ROOT" >&2; exit 2; }
source "$MH_ROOT/slurm/_common.sh"
mh_pretrain "$@"
