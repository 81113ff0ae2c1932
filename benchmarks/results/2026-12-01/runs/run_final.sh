#!/usr/bin/env bash
# GPU run F (one H200, 2026-12-01, session 4): final figures for the code as committed (few-token
# MoE defaults with TMA weight tiles): GPU GEMM/MoE tests, the MoE bench, the 20b model step.
source scripts/gpu/env.sh
mkdir -p $OUT/f
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/f/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/f/gemm_moe_gpu.log | head -12
timeout 200 python3 -m benchmarks.moe --quick > $OUT/f/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8 |targets|FAILED|Error" $OUT/f/moe.log | head -16
mv $OUT/*.json $OUT/f/ 2>/dev/null; tar czf $OUT/f.tgz -C $OUT f
timeout 220 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,4,32 --tag f > $OUT/f/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/f/model.log | head
mv $OUT/*.json $OUT/f/ 2>/dev/null
tar czf $OUT/f.tgz -C $OUT f && rm -rf $OUT/f
