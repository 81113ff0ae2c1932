#!/usr/bin/env bash
# GPU run S (one H200, 2026-12-01, session 3; S2 after moving quantisation out of the K loop; S3
# with routing + x quantisation fused into one launch and a warps/stages sweep): the few-token FP8 MoE path (kernels/moe_small.py):
# GPU tests (real dims, EP/TP shard, CUDA graph), a tile sweep at T = 1, the MoE bench with the
# grouped path beside it, and the 20b decode step (compare runs L/N/O).
source scripts/gpu/env.sh
mkdir -p $OUT/s
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -p no:cacheprovider > $OUT/s/gemm_moe_gpu.log 2>&1; echo "gpu tests rc=$?"; grep -E "^FAILED|passed|failed" $OUT/s/gemm_moe_gpu.log | head -8
timeout 300 python3 -m benchmarks.moe --quick --sweep-small > $OUT/s/moe.log 2>&1; echo "moe rc=$?"
grep -E "^sweep" $OUT/s/moe.log | head -12; grep -E "triton_fp8|expert GEMMs|breakdown|targets|FAILED" $OUT/s/moe.log | head -16
timeout 220 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,4,32 --tag s > $OUT/s/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/s/model.log | head
mv $OUT/*.json $OUT/s/ 2>/dev/null
tar czf $OUT/s.tgz -C $OUT s && rm -rf $OUT/s
