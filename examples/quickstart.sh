#!/usr/bin/env bash
# Quick start on any machine (CPU or one GPU): preprocess the shipped sample corpus with the shipped tokenizer,
# train a small BLOOM with DeepSpeed, save, export to Hugging Face format, and print a generated sample.
#
#   bash scripts/setup.sh && bash examples/quickstart.sh
#
# Knobs: QUICKSTART_ITERS (default 300), WORK (default runs/quickstart), NUM_PROCS (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEEPSPEED=${DEEPSPEED:-$(dirname "$PY")/deepspeed}
WORK=${WORK:-runs/quickstart}
ITERS=${QUICKSTART_ITERS:-300}
NUM_PROCS=${NUM_PROCS:-1}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu PRECISION=""
else
  PRECISION=${PRECISION:---bf16}
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
mkdir -p "$WORK"
rm -rf "$WORK/checkpoints" "$WORK/hf_model"

echo "== 1/4 preprocess examples/data/sample.jsonl"
"$PY" tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix "$WORK/sample" \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt \
  --dataset-impl mmap --tokenizer-type GPT2BPETokenizer --append-eod --workers 1

echo "== 2/4 train a small BLOOM for $ITERS iterations"
"$DEEPSPEED" --num_gpus "$NUM_PROCS" pretrain_bloom.py \
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --micro-batch-size 8 --global-batch-size $(( 8 * NUM_PROCS )) --train-iters "$ITERS" \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --warmup $(( ITERS / 10 )) --weight-decay 0.01 --clip-grad 1.0 \
  $PRECISION --deepspeed --data-path "$WORK/sample_text_document" --split 98,2,0 \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt \
  --save "$WORK/checkpoints" --save-interval "$ITERS" --log-interval $(( ITERS / 10 > 0 ? ITERS / 10 : 1 )) \
  --eval-interval "$ITERS" --eval-iters 4 --tensorboard-dir "$WORK/tensorboard"

echo "== 3/4 export to Hugging Face format"
"$PY" tools/merge_mp_partitions.py --model-type bloom --model-path "$WORK/checkpoints" \
  --output-path "$WORK/hf_model" --force

echo "== 4/4 generate"
"$PY" tools/generate_text.py --load "$WORK/hf_model" --prompt "Alice was beginning to" \
  --max-new-tokens 40 --greedy
"$PY" tools/plot_metrics.py "$WORK/tensorboard/metrics.jsonl" --output "$WORK/metrics.png"
echo "done: checkpoints in $WORK/checkpoints, Hugging Face model in $WORK/hf_model, curves in $WORK/metrics.png"
