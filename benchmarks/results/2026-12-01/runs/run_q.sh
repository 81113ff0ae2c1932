#!/usr/bin/env bash
# GPU run Q (one H200, 2026-12-01; again as Q2 with the split-K decode table): test_gemm_moe_gpu.py after the signed-zero fix of the e4m3
# rounding, DeepGEMM refusals skipped, and the unfused-requantisation reference.
source scripts/gpu/env.sh
mkdir -p $OUT/q
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/q/gemm_moe_gpu.log 2>&1; echo "gemm/moe gpu rc=$?"
grep -E "^FAILED|^E  +(AssertionError|assert)|passed|failed" $OUT/q/gemm_moe_gpu.log | head -20
tar czf $OUT/q.tgz -C $OUT q && rm -rf $OUT/q
