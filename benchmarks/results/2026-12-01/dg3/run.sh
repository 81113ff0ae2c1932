#!/usr/bin/env bash
# GPU run DG3 (one H200): row-stride check and MoE profile (scripts/gpu/diag_dg3.py), then the GEMM and
# MoE benchmarks with every backend side by side (DeepGEMM rows included). Launchers carried prebuilt.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg3
timeout 150 python3 -m scripts.gpu.diag_dg3 > $OUT/dg3/diag_dg3.log 2>&1; echo "diag rc=$?"
cut -c1-200 $OUT/dg3/diag_dg3.log | head -40
timeout 200 python3 -m benchmarks.gemm --quick > $OUT/dg3/gemm.log 2>&1; echo "gemm rc=$?"
mv $OUT/gemm.json $OUT/dg3/ 2>/dev/null
grep -E "M=8192|8192 |targets|modes" $OUT/dg3/gemm.log | cut -c1-220 | head -30
timeout 220 python3 -m benchmarks.moe --quick > $OUT/dg3/moe.log 2>&1; echo "moe rc=$?"
mv $OUT/moe.json $OUT/dg3/ 2>/dev/null
grep -E "8192|128 |targets" $OUT/dg3/moe.log | cut -c1-220 | head -30
