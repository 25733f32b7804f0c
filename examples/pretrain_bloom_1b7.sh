#!/usr/bin/env bash
# The document's BLOOM 1.7B (24 layers, hidden 2048, 16 heads, seq 2048) on the GPUs of this host.
#
#   NUM_GPUS=8 DATA_PATH=c4_en_text_document TOKENIZER=bloom_tokenizer bash examples/pretrain_bloom_1b7.sh
#
# With 8 GPUs it uses the document's layout (TP 4 x PP 2); with fewer it trains data-parallel (ZeRO-1),
# which is faster for a model of this size when it fits. Override with TP=... PP=... .
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
NUM_GPUS=$(( NUM_GPUS > 0 ? NUM_GPUS : 1 ))
if [ "$NUM_GPUS" -ge 8 ]; then TP=${TP:-4}; PP=${PP:-2}; else TP=${TP:-1}; PP=${PP:-1}; fi
DP=$(( NUM_GPUS / (TP * PP) ))
MICRO=${MICRO_BATCH:-4}
GLOBAL=${GLOBAL_BATCH:-$(( MICRO * DP * 8 ))}
DATA_PATH=${DATA_PATH:?set DATA_PATH to the prefix made by tools/preprocess_data.py}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the folder with vocab.json and merges.txt}
SAVE=${SAVE:-checkpoints/bloom_1b7}
DS=${DS_CONFIG:-examples/ds_config_zero1.json}
DEEPSPEED=${DEEPSPEED:-deepspeed}

exec "$DEEPSPEED" --num_gpus="$NUM_GPUS" pretrain_bloom.py \
  --model-parallel-size "$TP" --pipe-parallel-size "$PP" \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
  --max-position-embeddings 2048 --batch-size "$GLOBAL" --micro-batch-size "$MICRO" \
  --train-iters "${TRAIN_ITERS:-100000}" --lr 6e-5 --min-lr 1e-6 --lr-decay-style cosine --warmup 500 \
  --weight-decay 0.01 --clip-grad 1.0 --bf16 --deepspeed --deepspeed_config "$DS" \
  --zero-stage "$( [ "$PP" -gt 1 ] && echo 1 || echo "${ZERO_STAGE:-1}" )" \
  --data-path "$DATA_PATH" --vocab-file "$TOKENIZER/vocab.json" --merge-file "$TOKENIZER/merges.txt" \
  --pad-vocab-size-to "${PAD_VOCAB:-250880}" \
  --save "$SAVE" --load "$SAVE" --save-interval 1000 --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  --tensorboard-dir "$SAVE/tensorboard" --exit-signal-handler "$@"
