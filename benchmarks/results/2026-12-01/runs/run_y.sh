#!/usr/bin/env bash
# GPU run Y (one H200, 2026-12-01, session 4): as run X, after fusing the few-token path's routing
# and x quantisation into gate_up (two launches). Run X: the few-token MoE defaults chosen from runs U-W
# (swapped wgmma tiles, PDL, splits 2/4, stages by pair count) and the routing + quantisation
# launch split across programs with a one-pass top-k: GPU tests, the configs re-timed with a
# profile, the MoE bench, the 20b model step (decode b1/b4/b32 at 8k, prefill 8k).
source scripts/gpu/env.sh
mkdir -p $OUT/y
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/y/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/y/gemm_moe_gpu.log | head -12
timeout 150 python3 scripts/gpu/diag_w.py > $OUT/y/diag_w.log 2>&1; echo "diag rc=$?"; grep -v "^\s*$" $OUT/y/diag_w.log | grep -v "Warn\|warn" | cut -c1-160 | head -40
tar czf $OUT/y.tgz -C $OUT y
timeout 200 python3 -m benchmarks.moe --quick > $OUT/y/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8 |targets|FAILED|Error" $OUT/y/moe.log | head -16
mv $OUT/*.json $OUT/y/ 2>/dev/null; tar czf $OUT/y.tgz -C $OUT y
timeout 220 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,4,32 --tag y > $OUT/y/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/y/model.log | head
mv $OUT/*.json $OUT/y/ 2>/dev/null
tar czf $OUT/y.tgz -C $OUT y && rm -rf $OUT/y
