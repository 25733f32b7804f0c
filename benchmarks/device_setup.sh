# Sourced at the start of a device call (bash, from the repository root, with .whl carried): installs the carried
# wheels into /tmp/site and sets the environment the GPU machine needs (see ../shared/device/README.md).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
T0=${T0:-$(date +%s)}
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
