#!/usr/bin/env bash
# megahash quickstart on CPU (2 cores, < 10 min): install (into .venv: launch/install_cpu.sh), build a BPE tokenizer and shards of the
# offline Shakespeare corpus (with MD5 and LSH word-hash side shards; documents 1100+ held out),
# pretrain the tiny decoder on 2 DeepSpeed ranks, report validation perplexity, write
# SAVE_DIR/loss_curve.png, and evaluate with lm-eval on tasks built from the held-out part.
# Extra arguments are config overrides (the run goes to train.save_dir, default runs/quickstart), e.g.
#   bash launch/quickstart.sh model.embedding=proj train.save_dir=runs/qs_proj
# A run resumes from the checkpoint in its train.save_dir: give another model its own save_dir.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
echo "quickstart: [1/6] install (launch/install_cpu.sh)"
bash launch/install_cpu.sh
. launch/venv.sh && use_venv  # python3 and deepspeed below are those of the environment it installed into
# the config + overrides checked (pure Python, no torch import; a typo is one line, exit 2) and the run directory
SAVE_DIR=$(python3 megahash/pretrain.py --check config --config configs/quickstart.yaml "$@")
DATA=data/shakespeare
mkdir -p "$DATA"
if [ ! -f "$DATA/spm.model" ]; then
  echo "quickstart: [2/6] train a 4,000-piece BPE tokenizer on documents 0-1099 -> $DATA/spm.model"
  python3 data_tools/train_tokenizer.py --input shakespeare --doc-range 0:1100 --output "$DATA/spm" --vocab-size 4000 --quiet
fi
if [ ! -f "$DATA/shakespeare_text_document.idx" ]; then
  echo "quickstart: [3/6] preprocess documents 0-1099 into shards with md5/lsh128 side shards -> $DATA/shakespeare"
  python3 data_tools/preprocess_data.py --input shakespeare --doc-range 0:1100 --output-prefix "$DATA/shakespeare" \
    --tokenizer "$DATA/spm.model" --word-hashes md5,lsh128 --workers 2
fi
python3 data_tools/inspect_shards.py "$DATA/shakespeare" --verify | tail -n 3
if [ ! -f data/eval_tasks/shk_manifest.json ] || [ ! -f data/eval_tasks/shk_held_out.txt ]; then
  echo "quickstart: [4/6] build eval tasks from held-out documents 1100+ -> data/eval_tasks"
  python3 data_tools/make_eval_tasks.py --source shakespeare --held-out-docs 1100: --out data/eval_tasks --n 200
fi
echo "quickstart: [5/6] pretrain on 2 DeepSpeed CPU ranks -> $SAVE_DIR"
# shards, tokenizer and resume path checked before the launcher, whose output would bury the error line
python3 megahash/pretrain.py --check inputs --config configs/quickstart.yaml "$@" >/dev/null
# the launcher's own lines stay out: its INFO and "Unable to find hostfile" (--log_level error; the ranks'
# errors still show) and "Setting accelerator to CPU" (the accelerator named: DS_ACCELERATOR, megahash/accelerator/policy.py)
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(python3 -m megahash.accelerator)}
deepspeed --log_level error --num_gpus 2 megahash/pretrain.py --config configs/quickstart.yaml "$@"
python3 - "$SAVE_DIR" <<'PY'
import json, math, sys
run = sys.argv[1]
recs = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
valid = [r for r in recs if r["split"] == "valid"]
if valid:
    print(f"quickstart: validation loss {valid[0]['loss']:.3f} -> {valid[-1]['loss']:.3f} nats/token, "
          f"perplexity {math.exp(valid[-1]['loss']):.1f} after {valid[-1]['step']} steps; curve in {run}/loss_curve.png")
else:
    print(f"quickstart: no validation records in {run}/metrics.jsonl (train.eval_interval=0?)")
PY
echo "quickstart: [6/6] evaluate $SAVE_DIR with lm-eval on data/eval_tasks (shk_suite)"
python3 -m megahash eval --checkpoint "$SAVE_DIR" --tasks-dir data/eval_tasks --tasks shk_suite --overwrite
