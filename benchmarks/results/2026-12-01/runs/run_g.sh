#!/usr/bin/env bash
# GPU run G (one H200, 2026-12-01, session 4): the grouped (prefill) FP8 MoE with weight tiles by
# TMA: GPU tests, the 8k-token bucket re-tuned over TMA tiles, then the MoE bench with that table.
source scripts/gpu/env.sh
mkdir -p $OUT/g
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider -k "moe" > $OUT/g/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed|Error" $OUT/g/gemm_moe_gpu.log | head -8
timeout 150 python3 -m benchmarks.tune_moe --buckets 1024 --no-bf16 --wide --tma --base kernels/tuning/moe.json --budget 110 > $OUT/g/tune.log 2>&1; echo "tune rc=$?"
grep -E "'bucket': 1024" $OUT/g/tune.log | cut -c1-400 | head -4
mv $OUT/*.json $OUT/g/ 2>/dev/null; tar czf $OUT/g.tgz -C $OUT g
cp $OUT/g/moe.json kernels/tuning/moe.json 2>/dev/null
timeout 150 python3 -m benchmarks.moe --quick > $OUT/g/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8 .*8192|targets" $OUT/g/moe.log | head -6
mv $OUT/moe.json $OUT/g/moe_bench.json 2>/dev/null; mv $OUT/*.json $OUT/g/ 2>/dev/null
tar czf $OUT/g.tgz -C $OUT g && rm -rf $OUT/g
