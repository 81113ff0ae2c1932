#!/usr/bin/env bash
# GPU run DG17 (one H200, session 9): the few-token dense FP8 linear (kernels/dense_small.py):
# GPU parity + CUDA-graph replay tests, the decode-size comparison against the bf16 GEMV and
# DeepGEMM (scripts/gpu/diag_dg17.py), then the 20b model step with QKV/O bf16 (default) vs FP8 on
# the DeepGEMM linear, which now takes dense_small up to 64 rows. Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg17; mkdir -p $D
timeout 150 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "dense" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -2 $D/gpu_tests.log; grep -E "^FAILED|Error" $D/gpu_tests.log | head -5
timeout 200 python3 -m scripts.gpu.diag_dg17 > $D/diag_dg17.log 2>&1; echo "diag rc=$?"
cut -c1-100 $D/diag_dg17.log | grep -v Warning
for v in "deepgemm scaled_mm --bf16-attention" "deepgemm deepgemm"; do
  set -- $v
  tag=dg17-moe_$1-lin_$2${3:+-bf16attn}
  timeout 110 python3 -m benchmarks.bench_model --preset gpt-oss-20b --attention triton --moe $1 --linear $2 $3 \
    --prefill-lens 2048,8192 --contexts 8192 --batches 1,32 --tag $tag > $D/model_$tag.log 2>&1; echo "model $tag rc=$?"
  grep -E "^decode|^prefill|Error" $D/model_$tag.log | cut -c1-200 | head -8
done
mv $OUT/*.json $D/ 2>/dev/null
