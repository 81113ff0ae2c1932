#!/usr/bin/env bash
# GPU run DG9 (one H200, session 8): DG8 again after removing a wrong guard that sent every gpt-oss
# MoE (intermediate 2880, not a multiple of 128) to the Triton fallback, so DG8's "deepgemm" rows
# ran Triton. 1. DeepGEMM MoE GPU tests incl. TP2/TP4 intermediate shards; 2. disaggregated serving
# with the default MoE; 3. 120b on one H200, Triton vs DeepGEMM MoE prefill.
WHL=.whl-nixl source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg9; mkdir -p $D
timeout 120 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k deepgemm > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $D/gpu_tests.log
W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --kv-backend ipc --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12"
python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $D/prefill.log 2>&1 &
python3 -m launcher.cli decode-worker $W --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $D/decode.log 2>&1 &
timeout 150 python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 --out $D/disagg_smoke_default_moe.json > $D/smoke.log 2>&1; echo "smoke rc=$?"
tail -6 $D/smoke.log | cut -c1-250
grep -hE "MoE backend|backends:|Error|Traceback" $D/prefill.log $D/decode.log | cut -c1-250 | head -8
kill %1 %2; sleep 2; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli; sleep 1
for moe in triton deepgemm; do
  timeout 110 python3 -m benchmarks.bench_model --preset gpt-oss-120b --attention triton --moe $moe --bf16-attention \
    --prefill-lens 2048,8192 --contexts "" --tag dg9-120b-moe_$moe > $D/model_120b_$moe.log 2>&1; echo "120b $moe rc=$?"
  grep -E "^prefill|loaded|Error|memory" $D/model_120b_$moe.log | cut -c1-200 | head -5
done
mv $OUT/*.json $D/ 2>/dev/null
tar czf $OUT/dg9.tgz -C $OUT dg9 && rm -rf $OUT/dg9
