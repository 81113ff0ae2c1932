#!/usr/bin/env bash
# GPU run DG4 (one H200): the DeepGEMM MoE after the SwiGLU pass fix (contiguous loads): profile, the
# MoE benchmark with every backend side by side, the DeepGEMM GPU tests.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg4
timeout 100 python3 -m scripts.gpu.diag_dg3 profile > $OUT/dg4/profile.log 2>&1; echo "profile rc=$?"
grep -E "deep_gemm|_kernel" $OUT/dg4/profile.log | awk '{print $1, $(NF-3), $(NF-1), $NF}' | head -10
timeout 220 python3 -m benchmarks.moe --quick > $OUT/dg4/moe.log 2>&1; echo "moe rc=$?"
mv $OUT/moe.json $OUT/dg4/ 2>/dev/null
grep -E " 8192 | 128 |targets" $OUT/dg4/moe.log | cut -c1-220 | head -20
timeout 150 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "deepgemm or dense" > $OUT/dg4/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $OUT/dg4/gpu_tests.log
