#!/usr/bin/env bash
# GPU run DG5 (one H200): QKV-with-bias tile shapes on DeepGEMM (scripts/gpu/diag_dg5.py).
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg5
timeout 200 python3 -m scripts.gpu.diag_dg5 > $OUT/dg5/diag_dg5.log 2>&1; echo "diag rc=$?"
cut -c1-200 $OUT/dg5/diag_dg5.log | head -20
