#!/usr/bin/env bash
# Issue 26 on one GPU, run from the repository root after the DeepSpeed wheels are installed into /tmp/site:
#   bash benchmarks/fused_elementwise.sh [stage ...]        (default: tests bench)
# stages:
#   tests      GPU tests of the fused elementwise regions, the compiled blocks and the attention variants
#   blocks     short: ours eager, --compile-blocks and --fused-elementwise (2 timed steps each, no HF, no
#              profile; each side's line printed as it lands), then the GPU tests of --compile-blocks
#   bench      the document's model: ours (eager), --compile-blocks, --fused-elementwise, HF eager,
#              HF + torch.compile, each with a profile of one step (kernel time by category, idle)
#   attention  ours with each exact ALiBi attention variant (ATTENTION_VARIANTS, default below)
#   ckpt       ours with --checkpoint-activations: eager, --compile-blocks, --fused-elementwise
#   zero1      ours with --zero-stage 1 (DeepSpeed's flat-buffer bf16 optimizer instead of the per-parameter
#              unfused wrapper of ZeRO 0): eager, --compile-blocks, --fused-elementwise
#   pretrain   deepspeed --num_gpus 1 pretrain_bloom.py, the document's model on the sample corpus, eager then
#              --compile-blocks (ITERS iterations each, log every 5)
# Everything lands in $OUT (default /tmp/out); the tables are printed.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
table() { grep -v "^\[W" "$1" | sed -n '/^model {/,$p'; grep -E "failed|Error" "$1" | tail -5; }
for stage in "${@:-tests bench}"; do for stage in $stage; do
  echo "== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    tests)
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_elementwise.py tests/gpu/test_attention.py \
        > "$OUT/tests.log" 2>&1
      tail -15 "$OUT/tests.log" ;;
    blocks)
      python3 tools/benchmark_training.py --skip-hf --ab --iters 2 --warmup-iters 1 --output "$OUT/blocks.json" \
        2>&1 | tee "$OUT/blocks.log" | grep --line-buffered -E "^side |failed|Error"
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_elementwise.py \
        -k "compiled_blocks_model_equals_eager or compiled_blocks_under" > "$OUT/blocks_tests.log" 2>&1
      tail -4 "$OUT/blocks_tests.log" ;;
    bench)
      python3 tools/benchmark_training.py --ab --hf-compile --profile --profile-top 20 \
        --output "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      table "$OUT/bench.log" ;;
    attention)
      python3 tools/benchmark_training.py --skip-hf --iters 2 \
        --attention-variants "${ATTENTION_VARIANTS:-flex-safe,flex-128x64,sdpa-cudnn}" \
        --output "$OUT/attention.json" > "$OUT/attention.log" 2>&1
      table "$OUT/attention.log" ;;
    ckpt)
      python3 tools/benchmark_training.py --skip-hf --ab --checkpoint-activations --output "$OUT/ckpt.json" \
        > "$OUT/ckpt.log" 2>&1
      table "$OUT/ckpt.log" ;;
    zero1)
      python3 tools/benchmark_training.py --skip-hf --ab --zero-stage 1 --output "$OUT/zero1.json" \
        > "$OUT/zero1.log" 2>&1
      table "$OUT/zero1.log" ;;
    pretrain)
      python3 tools/preprocess_data.py --input examples/data/sample.jsonl --output-prefix /tmp/sample \
        --vocab-file examples/tokenizer/vocab.json --merge-file examples/tokenizer/merges.txt --dataset-impl mmap \
        --tokenizer-type GPT2BPETokenizer --append-eod --workers 4 > "$OUT/preprocess.log" 2>&1
      for variant in eager block; do
        extra=(); [ "$variant" = block ] && extra=(--compile-blocks)
        deepspeed --num_gpus 1 pretrain_bloom.py --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
          --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 \
          --train-iters "${ITERS:-20}" --lr 6e-5 --bf16 --deepspeed --zero-stage 0 \
          --data-path /tmp/sample_text_document --vocab-file examples/tokenizer/vocab.json \
          --merge-file examples/tokenizer/merges.txt --pad-vocab-size-to 250880 --log-interval 5 --eval-iters 0 \
          "${extra[@]}" > "$OUT/pretrain_$variant.log" 2>&1
        echo "-- pretrain $variant (exit $?)"
        grep -E "iteration +[0-9]+/|Error" "$OUT/pretrain_$variant.log" | sed 's/.*megatron.training: //' | tail -4
      done ;;
    *) echo "unknown stage $stage (tests, blocks, bench, attention, ckpt, zero1, pretrain)"; exit 2 ;;
  esac
done; done
