#!/usr/bin/env bash
# GPU run T (one H200, 2026-12-01, session 3): final numbers for the code as committed: dense GEMM
# bench (the quantiser with hardware e4m3 conversion is inside every full FP8 linear) and the whole
# MoE bench (all T, few-token path beside the grouped one).
source scripts/gpu/env.sh
mkdir -p $OUT/t
timeout 200 python3 -m benchmarks.gemm > $OUT/t/gemm.log 2>&1; echo "gemm rc=$?"
grep -E "^ +(qkv|o) +\| +8192" $OUT/t/gemm.log | head -12
timeout 300 python3 -m benchmarks.moe > $OUT/t/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8 |expert GEMMs|targets" $OUT/t/moe.log | head -24
mv $OUT/*.json $OUT/t/ 2>/dev/null
tar czf $OUT/t.tgz -C $OUT t && rm -rf $OUT/t
