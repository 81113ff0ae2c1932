#!/usr/bin/env bash
# GPU run A (one H200): attention, FP8 GEMM and MoE benchmarks (each with parity at real dims).
# Logs and JSON are packed into $OUT/kernels.tgz (the device tool returns at most 8 files).
source scripts/gpu/env.sh
mkdir -p $OUT/k
timeout ${T_ATTN:-300} python3 -m benchmarks.attention > $OUT/k/attention.log 2>&1; echo "attention rc=$?"
tail -15 $OUT/k/attention.log
timeout ${T_GEMM:-100} python3 -m benchmarks.gemm > $OUT/k/gemm.log 2>&1; echo "gemm rc=$?"
tail -12 $OUT/k/gemm.log
timeout ${T_MOE:-120} python3 -m benchmarks.moe > $OUT/k/moe.log 2>&1; echo "moe rc=$?"
tail -14 $OUT/k/moe.log
mv $OUT/*.json $OUT/k/ 2>/dev/null
tar czf $OUT/kernels.tgz -C $OUT k && rm -rf $OUT/k
ls -la $OUT
