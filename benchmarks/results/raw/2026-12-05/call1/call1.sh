set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH TORCH_CUDA_ARCH_LIST=9.0 || exit
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 150 python3 .gpu/cudnn_probe.py $OUT/probe.json 2>&1 | tee $OUT/probe.log | tail -40
timeout 240 python3 tools/benchmark_training.py --skip-hf --compile-blocks --attention-impl cudnn --iters 2 --warmup-iters 1 --profile --output $OUT/train_cudnn.json > $OUT/train_cudnn.log 2>&1; echo rc=$?
tail -45 $OUT/train_cudnn.log
timeout 150 python3 -m pytest -q -x tests/gpu/test_attention.py 2>&1 | tail -15 | tee $OUT/gpu_attn.log
