#!/usr/bin/env bash
# GPU run DG16 (one H200, session 9): GPU tests of the dense linear with the M-range tiles, the
# benchmarks.gemm quick sweep, and where a 20b decode step's time goes today (eager step under
# torch.profiler, batch 1 and 32, 8k context, Triton attention, the workers' MoE choice).
# Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg16; mkdir -p $D
timeout 200 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "deepgemm or dense or quant" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -2 $D/gpu_tests.log
timeout 150 python3 -m benchmarks.gemm --quick > $D/gemm.log 2>&1; echo "gemm rc=$?"
mv $OUT/gemm.json $D/ 2>/dev/null
grep -E "^ +(qkv|o) \| +(1|128|8192) \| +(deepgemm|bf16_torch)|fp8 in" $D/gemm.log | cut -c1-120 | head -30
timeout 200 python3 -m benchmarks.profile_decode --attention triton --batches 1,32 > $D/profile.log 2>&1; echo "profile rc=$?"
mv $OUT/profile_decode_b*.txt $D/ 2>/dev/null
grep -E "^###|CUDA kernels per step" $D/profile.log
for f in $D/profile_decode_b*.txt; do echo "== $f"; sed -n 4,64p $f | grep -v "^ *layer[0-9]" | head -28 | awk '{n=NF; print substr($0,1,72), $(n-4), $(n-3), $(n)}' ; done
