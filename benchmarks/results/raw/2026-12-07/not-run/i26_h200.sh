#!/usr/bin/env bash
# Issue 26's must-show in one H200 call (HF eager needs ~102 GiB: run with needs_h200): ours (--compile-blocks, --gemm-epilogues on by default) vs HF eager vs HF + torch.compile
# with the step profile, the same step through deepspeed pretrain_bloom.py on the sample corpus, then with
# --checkpoint-activations (the DGELU epilogue's GPU tests passed on an H100 on 2026-12-07: 24 passed). Run: BUDGET=570 bash benchmarks/results/raw/2026-12-07/not-run/i26_h200.sh
set -uo pipefail
T0=$(date +%s)
source benchmarks/device_setup.sh
echo "== ours vs HF eager vs HF + torch.compile $(date +%T) (left $(left)s)"
timeout 300 python3 tools/benchmark_training.py --compile-blocks --hf-compile --profile --profile-top 40 \
  --output $OUT/bench.json > $OUT/bench.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/bench.log | grep -E "^side |tokens/s|^ours|^hf|ratio|profile of one step" | head -16
echo "== pretrain_bloom.py, document flags + --compile-blocks, sample corpus $(date +%T) (left $(left)s)"
python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
  --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
  --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > $OUT/preprocess.log 2>&1
timeout $(( $(left) < 250 ? $(left) - 130 : 120 )) deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 \
  --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 \
  --micro-batch-size 4 --global-batch-size 32 --train-iters 20 --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
  --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
  --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
  --compile-blocks > $OUT/pretrain.log 2>&1
echo "exit $?"; grep -E "iteration +[0-9]+/|Error|epilogue" $OUT/pretrain.log | sed 's/.*megatron.training: //' | tail -5 | cut -c1-400
echo "== --checkpoint-activations $(date +%T) (left $(left)s)"
timeout $(( $(left) - 3 )) python3 tools/benchmark_training.py --skip-hf --compile-blocks --checkpoint-activations \
  --iters 2 --warmup-iters 1 --output $OUT/train_ckpt.json > $OUT/train_ckpt.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/train_ckpt.log | grep -E "^side " | head -2
echo "== PDL probe $(date +%T) (left $(left)s)"
timeout $(( $(left) - 3 )) python3 benchmarks/decode_pdl_probe.py --output $OUT/pdl_probe.json > $OUT/pdl_probe.log 2>&1
echo "exit $?"; grep -v "^\[W" $OUT/pdl_probe.log | tail -8 | cut -c1-300
echo "== end $(date +%T) (left $(left)s)"
