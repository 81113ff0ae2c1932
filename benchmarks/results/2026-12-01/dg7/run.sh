#!/usr/bin/env bash
# GPU run DG7 (one H200, session 8): the dense DeepGEMM linear with the bias in K = 2880's padding
# (GPU tests, interleaved timing with SM clock and power, benchmarks.gemm --quick), then the 20b
# model step with the MoE on DeepGEMM vs Triton (same process kinds, same attention backend).
# Launchers prebuilt on the CPU machine (scripts/gpu/diag_dg7.py --build-only), carried as .cache.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
D=$OUT/dg7; mkdir -p $D
timeout 150 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "deepgemm or dense or quant" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $D/gpu_tests.log
timeout 120 python3 -m scripts.gpu.diag_dg7 > $D/diag_dg7.log 2>&1; echo "diag rc=$?"
grep -v "round\|Warning" $D/diag_dg7.log | cut -c1-260 | head -12
timeout 90 python3 -m benchmarks.gemm --quick > $D/gemm.log 2>&1; echo "gemm rc=$?"
mv $OUT/gemm.json $D/ 2>/dev/null
grep -E " 8192 |targets" $D/gemm.log | cut -c1-200 | head -20
for v in "triton scaled_mm --bf16-attention" "deepgemm scaled_mm --bf16-attention" "deepgemm deepgemm"; do
  set -- $v
  tag=dg7-moe_$1-lin_$2${3:+-bf16attn}
  timeout 100 python3 -m benchmarks.bench_model --preset gpt-oss-20b --attention triton --moe $1 --linear $2 $3 \
    --prefill-lens 2048,8192 --contexts 8192 --batches 1,32 --tag $tag > $D/model_$tag.log 2>&1; echo "model $tag rc=$?"
  grep -E "^decode|^prefill|loaded|Error" $D/model_$tag.log | cut -c1-200 | head -8
done
mv $OUT/*.json $D/ 2>/dev/null
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
