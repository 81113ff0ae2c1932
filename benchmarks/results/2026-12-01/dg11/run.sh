#!/usr/bin/env bash
# GPU run DG11 (one H200, session 8): the many-program expert grouping (kernels/moe_align.py) and the
# SwiGLU pass's launch settings. 1. MoE GPU tests (Triton and DeepGEMM, prefill sizes take the new
# grouping); 2. layer profile + SwiGLU sweep (scripts/gpu/diag_dg11.py); 3. benchmarks.moe --quick.
# Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg11; mkdir -p $D
timeout 150 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "moe" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $D/gpu_tests.log
timeout 120 python3 -m scripts.gpu.diag_dg11 > $D/diag_dg11.log 2>&1; echo "diag rc=$?"
grep -E "_kernel|deep_gemm|^layer|^swiglu" $D/diag_dg11.log | awk '{ if ($1 ~ /^(swiglu|layer)/) print; else print $1, $(NF-3), $(NF-1), $NF }' | cut -c1-200 | head -20
timeout 150 python3 -m benchmarks.moe --quick > $D/moe.log 2>&1; echo "moe rc=$?"
mv $OUT/moe.json $D/ 2>/dev/null
grep -E " 8192 | 1 \||targets" $D/moe.log | cut -c1-220 | head -16
tar czf $OUT/dg11.tgz -C $OUT dg11 && rm -rf $OUT/dg11
