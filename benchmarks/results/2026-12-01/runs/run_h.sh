#!/usr/bin/env bash
# GPU run H (one H200, 2026-12-01, session 4): the 20b model step with run G's tuned table (TMA
# weight tiles for the 8k-token MoE bucket): prefill 8k, decode batch 1 at 8k.
source scripts/gpu/env.sh
mkdir -p $OUT/h
timeout 150 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1 --tag h > $OUT/h/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/h/model.log | head
mv $OUT/*.json $OUT/h/ 2>/dev/null
tar czf $OUT/h.tgz -C $OUT h && rm -rf $OUT/h
