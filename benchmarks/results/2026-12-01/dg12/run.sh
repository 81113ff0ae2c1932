#!/usr/bin/env bash
# GPU run DG12 (one H200, session 8): the final default path once more, end to end: prefill and
# decode workers on cuda:0 with no backend flags (MoE auto -> DeepGEMM, probed by building/loading
# its launchers), the many-program grouping and the SwiGLU settings of DG11 inside the real model;
# disaggregated greedy tokens must equal colocated, every page back. Carry [".whl-nixl", ".cache/dgcarry"].
WHL=.whl-nixl source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg12; mkdir -p $D
W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --kv-backend ipc --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12"
python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $D/prefill.log 2>&1 &
python3 -m launcher.cli decode-worker $W --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $D/decode.log 2>&1 &
timeout 130 python3 -m benchmarks.disagg_smoke --lengths 2048,8192 --burst 4 --out $D/disagg_smoke_final.json > $D/smoke.log 2>&1; echo "smoke rc=$?"
tail -4 $D/smoke.log | cut -c1-250
grep -hE "MoE backend|Error|Traceback" $D/prefill.log $D/decode.log | cut -c1-250 | head -6
kill %1 %2; sleep 1; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli
tar czf $OUT/dg12.tgz -C $OUT dg12 && rm -rf $OUT/dg12
