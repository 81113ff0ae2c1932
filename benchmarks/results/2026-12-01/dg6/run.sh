#!/usr/bin/env bash
# GPU run DG6 (one H200): dense tile shapes with bias in interleaved rounds (scripts/gpu/diag_dg6.py),
# then the GEMM benchmark's M = 8192 rows.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg6
timeout 240 python3 -m scripts.gpu.diag_dg6 > $OUT/dg6/diag_dg6.log 2>&1; echo "diag rc=$?"
cut -c1-220 $OUT/dg6/diag_dg6.log | grep -v Warning | head -20
