#!/usr/bin/env bash
# BigScience's BLOOM recipe (bigscience/train/tr11-176B-ml/tr11-176B-ml.slurm) with its flags unchanged, at small
# sizes: a 4-layer model on the shipped sample corpus, the batch-size ramp-up, the sample-based LR schedule, the
# kill switch, BLOOM's pipeline partition and tensorboard flags. 176B's values are in the comments.
#
#   bash examples/pretrain_bloom_tr11_small.sh                     # 2 processes, TP 1 x PP 2, CPU or GPUs
#   NUM_PROCS=8 TP_SIZE=2 PP_SIZE=4 bash examples/pretrain_bloom_tr11_small.sh
#   touch $WORK/kill-switch                                        # stops the run before its next iteration
#
# Knobs: WORK (runs/tr11_small: data, checkpoints, tensorboard), NUM_PROCS, TP_SIZE, PP_SIZE, DATA_PATH (default:
# the sample corpus, preprocessed here once), MASTER_PORT; extra arguments are passed to pretrain_bloom.py.
# Upstream reads its data through --train-weighted-split-paths-path; here --data-path takes the same datasets
# (with weights) and --split the ranges (the weighted-split file is refused in one line).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEEPSPEED=${DEEPSPEED:-$(dirname "$PY")/deepspeed}
WORK=${WORK:-runs/tr11_small}
NUM_PROCS=${NUM_PROCS:-2}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR=cpu; PRECISION=""   # fp32 on the CPU; tr11 trains in --bf16
else
  PRECISION=--bf16
fi
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
mkdir -p "$WORK"
if [ -z "${DATA_PATH:-}" ]; then
  DATA_PATH=$WORK/sample_text_document
  [ -f "$DATA_PATH.idx" ] || "$PY" tools/preprocess_data.py --input examples/data/sample.jsonl \
    --output-prefix "$WORK/sample" --tokenizer-type PretrainedFromHF --tokenizer-name-or-path examples/tokenizer \
    --dataset-impl mmap --append-eod --workers 1
fi

CHECKPOINT_PATH=$WORK/checkpoints
TENSORBOARD_PATH=$WORK/tensorboard
KILL_SWITCH_PATH=$WORK/kill-switch
TOKENIZER_NAME_OR_PATH=examples/tokenizer   # tr11: bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-...

TP_SIZE=${TP_SIZE:-1}         # 4
PP_SIZE=${PP_SIZE:-2}         # 12
NLAYERS=4                     # 70
NHIDDEN=64                    # 14336
NHEADS=4                      # 112
SEQ_LEN=32                    # 2048
SAVE_INTERVAL=4               # 100
MICRO_BATCH_SIZE=2            # 2
DP_SIZE=$(( NUM_PROCS / (TP_SIZE * PP_SIZE) ))
GLOBAL_BATCH_SIZE=$(( 4 * MICRO_BATCH_SIZE * DP_SIZE ))   # 2048
RAMPUP_START=$(( 2 * MICRO_BATCH_SIZE * DP_SIZE ))        # 192
RAMPUP_INCREMENT=$(( MICRO_BATCH_SIZE * DP_SIZE ))        # 16
RAMPUP_SAMPLES=$(( 2 * GLOBAL_BATCH_SIZE ))               # 9_765_625
TRAIN_SAMPLES=${TRAIN_SAMPLES:-$(( 12 * GLOBAL_BATCH_SIZE ))}   # 220_000_000

OPTIMIZER_ARGS=" \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 6e-4 \
    --min-lr 6e-5 \
    --lr-decay-style cosine \
    --lr-decay-samples $(( 10 * GLOBAL_BATCH_SIZE )) \
    --lr-warmup-samples $GLOBAL_BATCH_SIZE \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    "
# tr11: --lr 6e-5 --min-lr 6e-6 --lr-decay-samples 200_000_000 --lr-warmup-samples 216_320

EXIT_OPTS=" \
    --exit-duration-in-mins 5990 \
    "

GPT_ARGS=" \
    --pp-partition-method type:transformer|embedding \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --rampup-batch-size $RAMPUP_START $RAMPUP_INCREMENT $RAMPUP_SAMPLES \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples $TRAIN_SAMPLES \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path $TOKENIZER_NAME_OR_PATH \
    --init-method-std 0.0048 \
    --embed-layernorm \
    --sync-tp-duplicated-parameters \
    $PRECISION \
    --seed 42 \
    --position-embedding-type alibi \
    --checkpoint-activations \
    --abort-on-unmet-fused-kernel-constraints \
    --kill-switch-path $KILL_SWITCH_PATH \
    --pad-vocab-size-to 8192 \
    $OPTIMIZER_ARGS \
    $EXIT_OPTS \
    "
# tr11: --pad-vocab-size-to 250880

OUTPUT_ARGS=" \
    --log-interval 1 \
    --save-interval $SAVE_INTERVAL \
    --eval-interval 4 \
    --eval-iters 1 \
    --tensorboard-dir $TENSORBOARD_PATH \
    --tensorboard-queue-size 5 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "
# tr11: --eval-interval 1000

ZERO_STAGE=0 # important: bf16 must use z0! it implements its own zero stage 1 equivalent

config_json="$WORK/ds_config.json"
cat <<EOT > "$config_json"
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "bf16": {
    "enabled": $( [ -n "$PRECISION" ] && echo true || echo false )
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config ${config_json} \
    --zero-stage ${ZERO_STAGE} \
    --deepspeed-activation-checkpointing \
    "

# shellcheck disable=SC2086  # the recipe's flag strings split into words, as upstream's script splits them
exec "$DEEPSPEED" --num_gpus "$NUM_PROCS" --master_port "${MASTER_PORT:-29500}" pretrain_bloom.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path "$DATA_PATH" \
    --split 98,2,0 \
    --data-impl mmap \
    $DEEPSPEED_ARGS \
    "$@"
