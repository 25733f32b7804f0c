#!/usr/bin/env bash
# alt = branch i26bias (bias and LayerNorm gradients accumulated inside the compiled block), main = this tree
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
MAIN=$PWD ALT=$PWD/.gpu/alt
left() { echo $(( 590 - ($(date +%s) - T0) )); }
tps() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ours']['tokens_per_second'])" $1 2>/dev/null || echo 0; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== alt: ours --compile-blocks vs HF eager vs HF + torch.compile $(date +%T)"
(cd $ALT && PYTHONPATH=/tmp/site:$ALT timeout 300 python3 tools/benchmark_training.py --compile-blocks --hf-compile --profile --profile-top 40 --gaps --output $OUT/bench_alt.json > $OUT/bench_alt.log 2>&1)
echo "exit $?"; grep -v "^\[W" $OUT/bench_alt.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -24
echo "== main: ours only, same call $(date +%T)"
PYTHONPATH=/tmp/site:$MAIN timeout 120 python3 tools/benchmark_training.py --skip-hf --compile-blocks --profile --output $OUT/bench_main.json > $OUT/bench_main.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench_main.log | sed -n '/^model {/,$p' | grep -v "^ *[0-9.]* ms *[0-9]*x \[" | head -4
X=$MAIN NAME=main
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) > float(sys.argv[2]) else 1)" $(tps $OUT/bench_alt.json) $(tps $OUT/bench_main.json) && { X=$ALT NAME=alt; }
echo "== $NAME: pretrain_bloom.py on the sample corpus, --compile-blocks $(date +%T)"
cd $X
python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
  --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > $OUT/preprocess.log 2>&1
PYTHONPATH=/tmp/site:$X timeout 110 deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 \
  --train-iters 20 --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
  --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
  --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
  --compile-blocks > $OUT/pretrain_$NAME.log 2>&1
echo "exit $?"; grep -E "iteration +[0-9]+/|Error" $OUT/pretrain_$NAME.log | sed 's/.*megatron.training: //' | tail -4 | cut -c1-420
echo "== $NAME: --checkpoint-activations $(date +%T) (left $(left)s)"
PYTHONPATH=/tmp/site:$X timeout $(( $(left) - 5 )) python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations --iters 2 --warmup-iters 1 --output $OUT/train_ckpt_$NAME.json > $OUT/train_ckpt_$NAME.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_ckpt_$NAME.log | sed -n '/^model {/,$p' | head -4
if [ $NAME = alt ] && [ $(left) -gt 40 ]; then
  echo "== alt: GPU gradient-accumulation tests $(date +%T) (left $(left)s)"
  PYTHONPATH=/tmp/site:$ALT timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider tests/gpu/test_grad_accumulation.py > $OUT/alt_gpu_tests.log 2>&1
  echo "exit $?"; tail -4 $OUT/alt_gpu_tests.log
fi
echo "== end $(date +%T)"
