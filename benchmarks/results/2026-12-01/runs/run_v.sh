#!/usr/bin/env bash
# GPU run V (one H200, 2026-12-01, session 4): (1) torch._scaled_mm's wrong QKV result at K = 2944
# (run U) vs the weight-scale leading dimension, with and without the bias epilogue; (2) the
# few-token MoE path over explicit K splits and down tile widths, both MMA orientations, PDL on.
source scripts/gpu/env.sh
mkdir -p $OUT/v
timeout 150 python3 scripts/gpu/diag_v.py > $OUT/v/diag_v.log 2>&1; echo "diag rc=$?"; cat $OUT/v/diag_v.log | cut -c1-150 | head -40
tar czf $OUT/v.tgz -C $OUT v
timeout 300 python3 -m benchmarks.moe --quick --sweep-small > $OUT/v/moe.log 2>&1; echo "moe rc=$?"
grep -E "^sweep" $OUT/v/moe.log | head -30; grep -E "targets|FAILED|Error" $OUT/v/moe.log | head -8
mv $OUT/*.json $OUT/v/ 2>/dev/null
tar czf $OUT/v.tgz -C $OUT v && rm -rf $OUT/v
