#!/usr/bin/env bash
# GPU run DG1 (one H200): DeepGEMM's SM90 FP8 kernel through our launcher, dense and M-grouped, at the
# 20b prefill shapes, next to cuBLASLt. Launchers prebuilt on the CPU machine, carried as .cache/deepgemm.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg1
timeout 400 python3 -m scripts.gpu.diag_dg > $OUT/dg1/diag_dg.log 2>&1; echo "diag rc=$?"
cat $OUT/dg1/diag_dg.log | cut -c1-200 | head -80
