# The training flags the multi-node examples share (sourced): the document's BLOOM 1.7B (24 layers, hidden 2048,
# 16 heads, seq 2048, vocab 250880, bf16, ZeRO-1).
#
# Layout: TP x PP x DP = all processes; ranks go tensor-parallel fastest, then data-parallel, then pipeline
# (megatron/core/parallel_state.py), and node by node, so a TP group lies inside one node whenever TP divides
# the GPUs of a node: keep TP <= GPUs per node and let DP (or PP) cross the nodes, whose links are slower.
# Knobs: TP (default 4), PP (default 1), MICRO_BATCH (4), GLOBAL_BATCH (256, a multiple of MICRO_BATCH x DP),
# DATA_PATH, TOKENIZER (a folder with vocab.json and merges.txt), SAVE, TRAIN_ITERS, DS_CONFIG.
TP=${TP:-4}
PP=${PP:-1}
DATA_PATH=${DATA_PATH:?set DATA_PATH to the prefix made by tools/preprocess_data.py (on a filesystem every node sees)}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the folder with vocab.json and merges.txt}
SAVE=${SAVE:-checkpoints/bloom_1b7}
TRAIN_FLAGS=(
  --tensor-model-parallel-size "$TP" --pipe-parallel-size "$PP"
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
  --micro-batch-size "${MICRO_BATCH:-4}" --global-batch-size "${GLOBAL_BATCH:-256}"
  --train-iters "${TRAIN_ITERS:-100000}" --lr 6e-5 --min-lr 1e-6 --lr-decay-style cosine --warmup 500
  --weight-decay 0.01 --clip-grad 1.0 --bf16 --zero-stage 1
  --deepspeed --deepspeed_config "${DS_CONFIG:-examples/ds_config_zero1.json}"
  --data-path "$DATA_PATH" --vocab-file "$TOKENIZER/vocab.json" --merge-file "$TOKENIZER/merges.txt"
  --pad-vocab-size-to 250880
  --save "$SAVE" --load "$SAVE" --save-interval 1000 --log-interval 10 --eval-interval 1000 --eval-iters 10
  --tensorboard-dir "$SAVE/tensorboard" --exit-signal-handler
)
