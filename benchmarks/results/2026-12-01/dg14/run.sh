#!/usr/bin/env bash
# GPU run DG14 (one H200, session 9): the dense DeepGEMM linear with N/K compiled in, O's bias block
# on 128-byte rows and its own tile (DG13's findings): GPU tests, the full benchmarks.gemm sweep
# (M = 1..16k, every backend), then the 20b model step with FP8 attention projections on DeepGEMM
# vs the default bf16 ones (same attention backend as DG7). Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg14; mkdir -p $D
timeout 200 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "deepgemm or dense or quant" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -2 $D/gpu_tests.log
timeout 330 python3 -m benchmarks.gemm > $D/gemm.log 2>&1; echo "gemm rc=$?"
mv $OUT/gemm.json $D/ 2>/dev/null
grep -E "ceilings:| 8192 |targets" $D/gemm.log | cut -c1-180 | head -24
for v in "deepgemm scaled_mm --bf16-attention" "deepgemm deepgemm"; do
  set -- $v
  tag=dg14-moe_$1-lin_$2${3:+-bf16attn}
  timeout 100 python3 -m benchmarks.bench_model --preset gpt-oss-20b --attention triton --moe $1 --linear $2 $3 \
    --prefill-lens 2048,8192 --contexts 8192 --batches 1,32 --tag $tag > $D/model_$tag.log 2>&1; echo "model $tag rc=$?"
  grep -E "^decode|^prefill|Error" $D/model_$tag.log | cut -c1-200 | head -8
done
mv $OUT/*.json $D/ 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
