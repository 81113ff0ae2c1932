#!/usr/bin/env bash
# GPU run DG10 (one H200, session 8): the headline model configuration (FlashInfer attention, bf16
# attention projections) with the new default MoE (DeepGEMM) against the Triton MoE in the same run,
# 20b; then 120b on ONE H200 with DeepGEMM MoE (prefill + decode). FlashInfer JIT-builds its sink
# variants on first use (~2-3 min, this machine has no cache). Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg10; mkdir -p $D
for moe in deepgemm triton; do
  timeout 330 python3 -m benchmarks.bench_model --preset gpt-oss-20b --moe $moe --bf16-attention \
    --prefill-lens 2048,8192,32768 --contexts 8192 --batches 1,32,128 --tag dg10-20b-moe_$moe > $D/model_20b_$moe.log 2>&1
  echo "20b $moe rc=$?"; grep -E "^prefill|^decode|loaded|Error" $D/model_20b_$moe.log | cut -c1-170 | head -12
done
timeout 150 python3 -m benchmarks.bench_model --preset gpt-oss-120b --moe deepgemm --bf16-attention \
  --prefill-lens 8192 --contexts 8192 --batches 1,32 --tag dg10-120b-moe_deepgemm > $D/model_120b.log 2>&1
echo "120b rc=$?"; grep -E "^prefill|^decode|loaded|Error|memory" $D/model_120b.log | cut -c1-170 | head -6
mv $OUT/*.json $D/ 2>/dev/null
tar czf $OUT/dg10.tgz -C $OUT dg10 && rm -rf $OUT/dg10
