# shellcheck shell=bash
# Shared body of the megahash sbatch scripts (sourced by slurm/*.sh, never run by itself).
#
# A wrapper sets its #SBATCH header, MH_SCRIPT (its own path, for messages), optionally MH_SIZE
# (a size of configs/model/) and CONFIG default, sources this file and calls one of:
#   mh_pretrain "$@"              pretraining, one srun task per rank, signal -> checkpoint -> requeue
#   mh_single SUBCOMMAND "$@"     one process: python -m megahash SUBCOMMAND ... (eval, export-hf)
#
# Environment variables (all optional; trailing key=value arguments override everything):
#   CONFIG         experiment YAML (wrapper default; MH_SIZE wrappers without configs/pretrain_SIZE.yaml
#                  write SAVE_DIR/slurm_recipe_SIZE.yaml = the 500M Table 4.9 recipe at that size)
#   SAVE_DIR       train.save_dir (checkpoints, metrics.jsonl, logs)   DATA_PREFIX  data.prefix (space separated
#                  prefixes or "weight prefix" pairs)                  TOKENIZER    data.tokenizer
#   STEPS          train.steps          MICRO_BATCH  train.micro_batch_size   GLOBAL_BATCH train.global_batch_size
#   SCHEDULE       model.schedule       ZERO_STAGE   train.zero_stage         PRECISION    train.precision
#   TP             parallel.tensor      SAVE_INTERVAL train.save_interval     RESUME       train.resume (auto)
#   NODES          expected node count: refuse to start if the job has another (sbatch --nodes wins over
#                  the header, so this catches a wrong submission)
#   GPUS_PER_NODE  expected GPUs per node (checked against SLURM_GPUS_ON_NODE when SLURM reports it)
#   LAUNCHER       srun (default: one task per rank) | torchrun (one per node) | deepspeed | mpirun
#   REQUEUE        1 (default): requeue the job when the ranks stop on a signal (exit 3); 0: just exit 3
#   PYTHON         interpreter (default python3)        MEGAHASH_ROOT  checkout (default: the submit dir)

mh_fail() {
  echo "error: $*" >&2
  exit 2
}

mh_log() {
  echo "megahash-slurm: $*"
}

mh_require_slurm() {
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    mh_fail "${MH_SCRIPT:-this script} must run inside a SLURM job: submit it with 'sbatch ${MH_SCRIPT:-SCRIPT} ...'${1:+ ($1)}"
  fi
}

mh_check_allocation() {
  local nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
  if [ -n "${NODES:-}" ] && [ "$NODES" != "$nodes" ]; then
    mh_fail "NODES=$NODES but job $SLURM_JOB_ID has $nodes node(s) (${SLURM_JOB_NODELIST:-?}); submit with 'sbatch --nodes=$NODES ...' or set NODES=$nodes"
  fi
  local gpus=${SLURM_GPUS_ON_NODE:-}
  if [ -n "${GPUS_PER_NODE:-}" ] && [ -n "$gpus" ] && [ "$GPUS_PER_NODE" != "$gpus" ]; then
    mh_fail "GPUS_PER_NODE=$GPUS_PER_NODE but job $SLURM_JOB_ID has $gpus GPU(s) per node; submit with 'sbatch --gpus-per-node=$GPUS_PER_NODE ...'"
  fi
  local tpn=${SLURM_NTASKS_PER_NODE:-}
  if [ -n "$gpus" ] && [ -n "$tpn" ] && [ "$gpus" != "$tpn" ] && [ "${LAUNCHER:-srun}" = srun ]; then
    mh_log "warning: $tpn task(s) per node but $gpus GPU(s) per node; one rank per GPU needs --ntasks-per-node=$gpus"
  fi
}

# Config overrides from the environment variables above, in MH_OVERRIDES (an array).
mh_env_overrides() {
  MH_OVERRIDES=()
  [ -n "${SAVE_DIR:-}" ] && MH_OVERRIDES+=("train.save_dir=$SAVE_DIR")
  if [ -n "${DATA_PREFIX:-}" ]; then
    local joined
    joined=$(echo "$DATA_PREFIX" | xargs | tr ' ' ',')
    MH_OVERRIDES+=("data.prefix=[$joined]")
  fi
  [ -n "${TOKENIZER:-}" ] && MH_OVERRIDES+=("data.tokenizer=$TOKENIZER")
  [ -n "${STEPS:-}" ] && MH_OVERRIDES+=("train.steps=$STEPS")
  [ -n "${MICRO_BATCH:-}" ] && MH_OVERRIDES+=("train.micro_batch_size=$MICRO_BATCH")
  [ -n "${GLOBAL_BATCH:-}" ] && MH_OVERRIDES+=("train.global_batch_size=$GLOBAL_BATCH")
  [ -n "${SCHEDULE:-}" ] && MH_OVERRIDES+=("model.schedule=$SCHEDULE")
  [ -n "${ZERO_STAGE:-}" ] && MH_OVERRIDES+=("train.zero_stage=$ZERO_STAGE")
  [ -n "${PRECISION:-}" ] && MH_OVERRIDES+=("train.precision=$PRECISION")
  [ -n "${TP:-}" ] && MH_OVERRIDES+=("parallel.tensor=$TP")
  [ -n "${SAVE_INTERVAL:-}" ] && MH_OVERRIDES+=("train.save_interval=$SAVE_INTERVAL")
  MH_OVERRIDES+=("train.resume=${RESUME:-auto}")
}

# CONFIG for size wrappers: configs/pretrain_SIZE.yaml if it exists, else a generated recipe file
# (the 500M run's Table 4.9 hyperparameters at model size SIZE, standard attention).
mh_size_config() {
  [ -n "${CONFIG:-}" ] && return 0
  if [ -f "configs/pretrain_${MH_SIZE}.yaml" ]; then
    CONFIG="configs/pretrain_${MH_SIZE}.yaml"
    return 0
  fi
  mkdir -p "$SAVE_DIR" || mh_fail "cannot create SAVE_DIR=$SAVE_DIR"
  CONFIG="$SAVE_DIR/slurm_recipe_${MH_SIZE}.yaml"
  cat > "$CONFIG" <<EOF
# Written by slurm/_common.sh for ${MH_SCRIPT}: the 500M run's Table 4.9 recipe at size ${MH_SIZE}.
include: [pretrain_500m_hybrid.yaml, model/${MH_SIZE}.yaml]
model:
  schedule: uniform:mha
EOF
}

# MH_CHILD and its descendants (the launcher and, for launchers that do not forward signals, the ranks)
_mh_tree() {
  local c
  echo "$1"
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    _mh_tree "$c"
  done
}

_mh_forward() {
  mh_log "received SIG$1: forwarding to the ranks (they checkpoint at the next step boundary and exit 3)"
  MH_SIGNALLED=$1
  [ -n "${MH_CHILD:-}" ] || return 0
  if [ "$1" = USR1 ] && [ "${LAUNCHER:-srun}" = mpirun ]; then
    # mpirun runs with SIGUSR1 ignored; its ranks on this node get the signal directly
    kill -s USR1 $(_mh_tree "$MH_CHILD") 2>/dev/null
  else
    # srun forwards it to every task; launch/supervise.py (LAUNCHER=deepspeed, and torchrun's
    # per-node agents under srun) to every rank, also to ranks still starting (they keep it and
    # stop at their first step boundary, so an early time-limit signal cannot requeue a job that
    # made no progress)
    kill -s "$1" "$MH_CHILD" 2>/dev/null
  fi
  return 0
}

# Wait for MH_CHILD, surviving trapped signals (bash's wait returns >128 when a trap runs).
_mh_wait() {
  local status
  while true; do
    wait "$MH_CHILD"
    status=$?
    if [ "$status" -gt 128 ] && kill -0 "$MH_CHILD" 2>/dev/null; then
      continue
    fi
    return "$status"
  done
}

# A hang report of this job's ranks (train.watchdog.timeout_s / factor, megahash/training/watchdog.py):
# the first SAVE_DIR/hang/rank*.txt written since MH_STARTED, if any. The rank whose watchdog fired
# exits 3, but a rank that could not run its own (stopped, stuck in the kernel) is killed by srun
# after --wait and srun then reports 137: the report says it was a hang, so the job is requeued.
mh_hang_report() {
  local a dir overrides=()
  for a in "$@"; do  # the key=value overrides (not launcher options such as --srun-wait=N)
    [[ "$a" =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]] && overrides+=("$a")
  done
  dir=$("$PYTHON" megahash/pretrain.py --check config --config "$CONFIG" "${MH_OVERRIDES[@]}" "${overrides[@]}" \
        2>/dev/null | tail -n 1) || return 0
  [ -d "$dir/hang" ] && find "$dir/hang" -maxdepth 1 -name 'rank*.txt' -newermt "@$MH_STARTED" 2>/dev/null | head -n 1
  return 0
}

mh_pretrain() {
  mh_require_slurm "without SLURM: python -m launch --config CONFIG key=value ..., see docs/launching.md"
  cd "$MH_ROOT" || mh_fail "cannot cd to $MH_ROOT"
  mh_check_allocation
  PYTHON=${PYTHON:-python3}
  if [ -n "${MH_SIZE:-}" ]; then
    mh_size_config
  fi
  [ -n "${CONFIG:-}" ] || mh_fail "no CONFIG"
  [ -f "$CONFIG" ] || mh_fail "CONFIG=$CONFIG does not exist (relative paths start at $MH_ROOT)"
  mh_env_overrides
  mh_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: ${SLURM_JOB_NUM_NODES:-1} node(s) ${SLURM_JOB_NODELIST:-}, ${SLURM_NTASKS:-1} rank(s), config $CONFIG, $(date -u +%FT%TZ)"
  MH_SIGNALLED=
  MH_STARTED=$(date +%s)
  trap '_mh_forward USR1' USR1
  trap '_mh_forward TERM' TERM
  # started with SIGUSR1 ignored until it installs a handler (srun, launch/supervise.py) or for good
  # (mpirun); the ranks install theirs first thing (megahash.training.signals.install_early)
  (trap '' USR1; exec "$PYTHON" -m launch --launcher "${LAUNCHER:-srun}" --config "$CONFIG" "${MH_OVERRIDES[@]}" "$@") &
  MH_CHILD=$!
  _mh_wait
  local status=$?
  trap - USR1 TERM
  mh_log "ranks exited with status $status${MH_SIGNALLED:+ after SIG$MH_SIGNALLED}"
  if [ "$status" -ne 0 ] && [ "$status" -ne 3 ] && [ -z "$MH_SIGNALLED" ]; then
    local hung
    hung=$(mh_hang_report "$@")
    if [ -n "$hung" ]; then
      mh_log "a rank's hang watchdog fired ($hung; the ranks left behind were ended): status 3"
      status=3
    fi
  fi
  # a wrapper may define mh_after_pretrain (e.g. slurm/sweep_array.sh: evaluate the cell); it runs
  # only after a complete, unsignalled training and its status becomes the job's
  if [ "$status" -eq 0 ] && [ -z "$MH_SIGNALLED" ] && declare -F mh_after_pretrain >/dev/null; then
    mh_after_pretrain
    status=$?
  fi
  # requeue: the ranks stopped on a signal after checkpointing (3: srun and launch/supervise.py report
  # it), or this shell forwarded SIGUSR1 and the launcher did not report 0 (mpirun; a rank killed
  # by the signal before its handler existed resumes from the previous checkpoint).
  # Never after SIGTERM to this shell: that is scancel or the time limit ending the job.
  if [ "$MH_SIGNALLED" = TERM ]; then
    mh_log "job $SLURM_JOB_ID is being ended (SIGTERM); not requeueing, resubmit to resume"
  elif [ "$status" -eq 3 ] || { [ "$MH_SIGNALLED" = USR1 ] && [ "$status" -ne 0 ]; }; then
    if [ "${REQUEUE:-1}" = 1 ]; then
      mh_log "stopped on a signal; requeueing job $SLURM_JOB_ID (it resumes from the newest complete checkpoint, train.resume=auto)"
      if scontrol requeue "$SLURM_JOB_ID"; then
        # slurmctld now ends this script; do not report completion before it does
        sleep 60
      fi
      mh_log "requeue of job $SLURM_JOB_ID failed; resubmit the same command to resume"
    else
      mh_log "stopped on a signal; REQUEUE=0, resubmit the same command to resume"
    fi
  fi
  exit "$status"
}

mh_single() {
  mh_require_slurm "without SLURM: python -m megahash $1 ..."
  cd "$MH_ROOT" || mh_fail "cannot cd to $MH_ROOT"
  mh_check_allocation
  PYTHON=${PYTHON:-python3}
  mh_log "job $SLURM_JOB_ID on ${SLURMD_NODENAME:-?}: $PYTHON -m megahash $*"
  exec "$PYTHON" -m megahash "$@"
}
