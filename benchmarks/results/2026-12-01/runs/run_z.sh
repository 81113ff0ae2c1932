#!/usr/bin/env bash
# GPU run Z (one H200, 2026-12-01, session 4): the few-token MoE path with its weight tiles loaded
# by TMA (tensor descriptors) beside run Y's defaults: GPU tests, configurations timed and profiled.
source scripts/gpu/env.sh
mkdir -p $OUT/z
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/z/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/z/gemm_moe_gpu.log | head -12
timeout 150 python3 scripts/gpu/diag_w.py > $OUT/z/diag_w.log 2>&1; echo "diag rc=$?"; grep -v "^\s*$" $OUT/z/diag_w.log | grep -v "Warn\|warn" | cut -c1-160 | head -60
tar czf $OUT/z.tgz -C $OUT z && rm -rf $OUT/z
