# For an ad-hoc device-tool command (suites do this themselves: `tandem bench suite NAME`):
#   source scripts/gpu/env.sh && python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py
# The suite runner's GPU set-up (benchmarks/gpu_env.py) as exports: carried wheels (.whl, .whl-nixl)
# installed into /tmp/site, NVLink multicast off, FlashInfer (.cache/fi) and DeepGEMM (.cache/dgcarry)
# carries restored. Carry what the command needs, e.g. [".whl", ".cache/dgcarry"].
eval "$(python3 -m benchmarks.gpu_env --shell)"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
