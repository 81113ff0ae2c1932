#!/usr/bin/env bash
# GPU run R (one H200, 2026-12-01, session 3): the 1x128 quantiser with the hardware e4m3
# conversion (bits vs reference, GB/s per row block), DeepGEMM called directly with its errors
# printed (dense QKV/O at M = 8192, grouped contiguous MoE at 8k), GPU GEMM/MoE tests, MoE bench.
source scripts/gpu/env.sh
mkdir -p $OUT/r
timeout 240 python3 scripts/gpu/diag_r.py > $OUT/r/diag.log 2>&1; echo "diag rc=$?"
grep -E "^quant|^dg|^deep_gemm|Error|error:" $OUT/r/diag.log | head -30
timeout 170 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/r/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/r/gemm_moe_gpu.log
timeout 120 python3 -m benchmarks.moe --quick > $OUT/r/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8|expert GEMMs|breakdown|targets" $OUT/r/moe.log | head -12
mv $OUT/*.json $OUT/r/ 2>/dev/null
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
