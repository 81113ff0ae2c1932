#!/usr/bin/env bash
# GPU run X (one H200, 2026-12-01, session 4): the few-token MoE defaults chosen from runs U-W
# (swapped wgmma tiles, PDL, splits 2/4, stages by pair count) and the routing + quantisation
# launch split across programs with a one-pass top-k: GPU tests, the configs re-timed with a
# profile, the MoE bench, the 20b model step (decode b1/b4/b32 at 8k, prefill 8k).
source scripts/gpu/env.sh
mkdir -p $OUT/x
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/x/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/x/gemm_moe_gpu.log | head -12
timeout 150 python3 scripts/gpu/diag_w.py > $OUT/x/diag_w.log 2>&1; echo "diag rc=$?"; grep -v "^\s*$" $OUT/x/diag_w.log | grep -v "Warn\|warn" | cut -c1-160 | head -40
tar czf $OUT/x.tgz -C $OUT x
timeout 200 python3 -m benchmarks.moe --quick > $OUT/x/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8 |targets|FAILED|Error" $OUT/x/moe.log | head -16
mv $OUT/*.json $OUT/x/ 2>/dev/null; tar czf $OUT/x.tgz -C $OUT x
timeout 220 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,4,32 --tag x > $OUT/x/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/x/model.log | head
mv $OUT/*.json $OUT/x/ 2>/dev/null
tar czf $OUT/x.tgz -C $OUT x && rm -rf $OUT/x
