#!/usr/bin/env bash
# GPU run U (one H200, 2026-12-01, session 4): few-token MoE path with swapped wgmma tiles and
# programmatic dependent launch (GPU tests incl. CUDA-graph replay, sweep at T = 1, 2); the prefill
# MoE tiles re-tuned over a wider space (bucket 1024 = 8k tokens of 20b); FlashInfer's
# TensorRT-LLM block-scaled GEMM probed beside cuBLASLt at the dense M = 8192 shapes.
source scripts/gpu/env.sh
mkdir -p $OUT/u
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/u/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/u/gemm_moe_gpu.log | head -12
timeout 200 python3 -m benchmarks.moe --quick --sweep-small > $OUT/u/moe.log 2>&1; echo "moe rc=$?"
grep -E "^sweep" $OUT/u/moe.log | head -30; grep -E "triton_fp8|targets|FAILED|Error" $OUT/u/moe.log | head -16
timeout 150 python3 -m benchmarks.tune_moe --buckets 1024 --no-bf16 --wide --base kernels/tuning/moe.json --budget 120 > $OUT/u/tune.log 2>&1; echo "tune rc=$?"
grep -E "'bucket': 1024" $OUT/u/tune.log | head -4
mv $OUT/*.json $OUT/u/ 2>/dev/null
tar czf $OUT/u.tgz -C $OUT u
timeout 150 python3 scripts/gpu/diag_u.py > $OUT/u/diag_u.log 2>&1; echo "diag rc=$?"; grep -vE "^\s*$" $OUT/u/diag_u.log | tail -14
tar czf $OUT/u.tgz -C $OUT u && rm -rf $OUT/u
