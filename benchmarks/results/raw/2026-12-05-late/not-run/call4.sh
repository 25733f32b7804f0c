#!/usr/bin/env bash
# H100 A/B: alt = branch i26bias (bias and LayerNorm gradients accumulated inside the compiled block), main = this tree
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
MAIN=$PWD ALT=$PWD/.gpu/alt
left() { echo $(( 425 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for side in alt main; do
  D=$MAIN; [ $side = alt ] && D=$ALT
  echo "== $side: ours --compile-blocks $(date +%T)"
  (cd $D && PYTHONPATH=/tmp/site:$D timeout 110 python3 tools/benchmark_training.py --skip-hf --compile-blocks --profile --profile-top 40 --output $OUT/bench_$side.json > $OUT/bench_$side.log 2>&1)
  echo "exit $?"; grep -v "^\[W" $OUT/bench_$side.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -4
done
grep -hE "AccumulateGrad|CUDAFunctor_add|reduce_kernel|red_fused" $OUT/bench_alt.log $OUT/bench_main.log | head -20
echo "== alt: GPU tests $(date +%T) (left $(left)s)"
(cd $ALT && PYTHONPATH=/tmp/site:$ALT timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_grad_accumulation.py > $OUT/alt_gpu_tests.log 2>&1)
echo "exit $?"; tail -4 $OUT/alt_gpu_tests.log
echo "== alt: pretrain_bloom.py on the sample corpus, --compile-blocks $(date +%T) (left $(left)s)"
cd $ALT
python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
  --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > $OUT/preprocess.log 2>&1
PYTHONPATH=/tmp/site:$ALT timeout $(( $(left) - 3 )) deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 \
  --train-iters 20 --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
  --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
  --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
  --compile-blocks > $OUT/pretrain_alt.log 2>&1
echo "exit $?"; grep -E "iteration +[0-9]+/|Error" $OUT/pretrain_alt.log | sed 's/.*megatron.training: //' | tail -4 | cut -c1-420
echo "== end $(date +%T)"
