#!/usr/bin/env bash
# GPU run DG18 (one H200, session 9): the whole GEMM/MoE GPU test file on the final code of the
# session (Triton MoE and few-token MoE kernels use the quantiser fixed after f17c36f; DeepGEMM
# dense with compiled shapes and M-range tiles; DeepGEMM MoE). Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg18; mkdir -p $D
timeout 400 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $D/gpu_tests.log; grep -E "^FAILED" $D/gpu_tests.log | head -10
