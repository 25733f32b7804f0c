#!/usr/bin/env bash
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== ours --compile-blocks vs HF eager vs HF + torch.compile $(date +%T)"
timeout 330 python3 tools/benchmark_training.py --compile-blocks --hf-compile --profile --profile-top 40 --gaps --origins reduce_kernel,Memcpy,CatArray --output $OUT/bench.json > $OUT/bench.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -60
echo "== pretrain_bloom.py on the sample corpus, --compile-blocks $(date +%T)"
python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
  --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > $OUT/preprocess.log 2>&1
timeout 140 deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 \
  --train-iters 20 --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
  --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
  --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
  --compile-blocks > $OUT/pretrain_block.log 2>&1
echo "exit $?"; grep -E "attention:|iteration +[0-9]+/|Error" $OUT/pretrain_block.log | sed 's/.*megatron.training: //' | tail -6
left=$(( 575 - ($(date +%s) - T0) ))
echo "== --checkpoint-activations $(date +%T) (left ${left}s)"
timeout $left python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations --iters 2 --warmup-iters 1 --output $OUT/train_ckpt.json > $OUT/train_ckpt.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_ckpt.log | sed -n '/^model {/,$p' | head -4
echo "== end $(date +%T)"
