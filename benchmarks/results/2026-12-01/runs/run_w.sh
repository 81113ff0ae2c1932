#!/usr/bin/env bash
# GPU run W (one H200, 2026-12-01, session 4): few-token MoE path, leading configurations of run V
# re-timed with two weight seeds, and a kernel-level profile of one graph replay.
source scripts/gpu/env.sh
mkdir -p $OUT/w
timeout 200 python3 scripts/gpu/diag_w.py > $OUT/w/diag_w.log 2>&1; echo "diag rc=$?"; grep -v "^\s*$" $OUT/w/diag_w.log | cut -c1-160 | tail -60
tar czf $OUT/w.tgz -C $OUT w && rm -rf $OUT/w
