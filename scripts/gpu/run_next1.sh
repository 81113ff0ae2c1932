#!/usr/bin/env bash
# GPU run for the next session on one H200 (written 2026-12-01, session 4, not yet run): the prefill
# MoE bucket 256 (120b at 8k tokens, 20b at 2k) re-tuned with TMA weight tiles, then the MoE bench
# with that table (its EP4-rank rows decide SmallBatchMoE(ep_split_scale=True)), then the 20b step.
source scripts/gpu/env.sh
mkdir -p $OUT/n1
timeout 150 python3 -m benchmarks.tune_moe --buckets 256 --no-bf16 --wide --tma --base kernels/tuning/moe.json --budget 120 > $OUT/n1/tune.log 2>&1; echo "tune rc=$?"
grep -E "'bucket': 256" $OUT/n1/tune.log | cut -c1-300 | head -4
mv $OUT/*.json $OUT/n1/ 2>/dev/null; tar czf $OUT/n1.tgz -C $OUT n1
cp $OUT/n1/moe.json kernels/tuning/moe.json 2>/dev/null
timeout 200 python3 -m benchmarks.moe --quick > $OUT/n1/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8|targets" $OUT/n1/moe.log | head -24
mv $OUT/moe.json $OUT/n1/moe_bench.json 2>/dev/null; tar czf $OUT/n1.tgz -C $OUT n1
timeout 220 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 2048,8192 --contexts 8192 --batches 1,4,32 --tag n1 > $OUT/n1/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/n1/model.log | head
mv $OUT/*.json $OUT/n1/ 2>/dev/null
tar czf $OUT/n1.tgz -C $OUT n1 && rm -rf $OUT/n1
