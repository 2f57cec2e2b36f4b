#!/usr/bin/env bash
# megahash quickstart on CPU (2 cores, < 10 min): install, build a BPE tokenizer and shards of the
# offline Shakespeare corpus (with MD5 and LSH word-hash side shards; documents 1100+ held out),
# pretrain the tiny decoder on 2 DeepSpeed ranks, report validation perplexity, write
# runs/quickstart/loss_curve.png, and evaluate with lm-eval on tasks built from the held-out part.
# Extra arguments are config overrides, e.g.  bash launch/quickstart.sh model.embedding=proj
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline}
bash launch/install_cpu.sh
DATA=data/shakespeare
mkdir -p "$DATA"
if [ ! -f "$DATA/spm.model" ]; then
  python3 data_tools/train_tokenizer.py --input shakespeare --doc-range 0:1100 --output "$DATA/spm" --vocab-size 4000 --quiet
fi
if [ ! -f "$DATA/shakespeare_text_document.idx" ]; then
  python3 data_tools/preprocess_data.py --input shakespeare --doc-range 0:1100 --output-prefix "$DATA/shakespeare" \
    --tokenizer "$DATA/spm.model" --word-hashes md5,lsh128 --workers 2
fi
python3 data_tools/inspect_shards.py "$DATA/shakespeare" --verify | tail -n 3
[ -f data/eval_tasks/shk_manifest.json ] || python3 data_tools/make_eval_tasks.py --source shakespeare \
  --held-out-docs 1100: --out data/eval_tasks --n 200
deepspeed --num_gpus 2 megahash/pretrain.py --config configs/quickstart.yaml "$@"
python3 - <<'PY'
import json, math
recs = [json.loads(l) for l in open("runs/quickstart/metrics.jsonl")]
valid = [r for r in recs if r["split"] == "valid"]
print(f"quickstart: validation loss {valid[0]['loss']:.3f} -> {valid[-1]['loss']:.3f} nats/token, "
      f"perplexity {math.exp(valid[-1]['loss']):.1f} after {valid[-1]['step']} steps; "
      f"curve in runs/quickstart/loss_curve.png")
PY
python3 -m megahash eval --checkpoint runs/quickstart --tasks-dir data/eval_tasks --tasks shk_suite
