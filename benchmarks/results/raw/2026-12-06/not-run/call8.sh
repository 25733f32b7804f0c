#!/usr/bin/env bash
# H200, short budget: issue 26's must-show on main (ours vs HF eager vs HF + torch.compile), pretrain_bloom on main,
# then i26bias (alt) ours-only for the A/B, then --checkpoint-activations
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
MAIN=$PWD ALT=$PWD/.gpu/alt
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== main: ours --compile-blocks vs HF eager vs HF + torch.compile $(date +%T)"
PYTHONPATH=/tmp/site:$MAIN timeout 300 python3 tools/benchmark_training.py --compile-blocks --hf-compile --profile --profile-top 40 --output $OUT/bench_main.json > $OUT/bench_main.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench_main.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -24
echo "== main: pretrain_bloom.py on the sample corpus, --compile-blocks $(date +%T) (left $(left)s)"
python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
  --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > $OUT/preprocess.log 2>&1
PYTHONPATH=/tmp/site:$MAIN timeout $(( $(left) < 110 ? $(left) - 3 : 110 )) deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 \
  --train-iters 20 --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
  --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
  --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
  --compile-blocks > $OUT/pretrain_main.log 2>&1
echo "exit $?"; grep -E "iteration +[0-9]+/|Error" $OUT/pretrain_main.log | sed 's/.*megatron.training: //' | tail -4 | cut -c1-420
if [ $(left) -gt 70 ]; then
echo "== alt: ours --compile-blocks $(date +%T) (left $(left)s)"
(cd $ALT && PYTHONPATH=/tmp/site:$ALT timeout $(( $(left) < 100 ? $(left) - 3 : 100 )) python3 tools/benchmark_training.py --skip-hf --compile-blocks --profile --profile-top 40 --output $OUT/bench_alt.json > $OUT/bench_alt.log 2>&1)
echo "exit $?"; grep -v "^\[W" $OUT/bench_alt.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -4
fi
if [ $(left) -gt 50 ]; then
echo "== main: --checkpoint-activations $(date +%T) (left $(left)s)"
PYTHONPATH=/tmp/site:$MAIN timeout $(( $(left) - 3 )) python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations --iters 2 --warmup-iters 1 --output $OUT/train_ckpt_main.json > $OUT/train_ckpt_main.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_ckpt_main.log | sed -n '/^model {/,$p' | head -4
fi
echo "== end $(date +%T)"
