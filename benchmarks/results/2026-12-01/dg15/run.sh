#!/usr/bin/env bash
# GPU run DG15 (one H200, session 9): (1) the dense FP8 linear at decode sizes, narrower DeepGEMM
# tiles vs the bf16 GEMV (scripts/gpu/diag_dg15.py); (2) disaggregated == colocated on the default
# path again after the quantiser fix (bf16 QKV/O, MoE auto -> DeepGEMM); (3) the same with FP8 QKV/O
# on the DeepGEMM linear (launchers prepared from the model's shapes at start-up).
# Carry [".whl-nixl", ".cache/dgcarry"].
WHL=.whl-nixl source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg15; mkdir -p $D
timeout 240 python3 -m scripts.gpu.diag_dg15 > $D/diag_dg15.log 2>&1; echo "diag rc=$?"
cut -c1-120 $D/diag_dg15.log | grep -v Warning
smoke() {  # tag, extra worker flags
  local tag=$1; shift
  W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --kv-backend ipc --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12 $*"
  python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $D/prefill_$tag.log 2>&1 &
  local p1=$!
  python3 -m launcher.cli decode-worker $W --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $D/decode_$tag.log 2>&1 &
  local p2=$!
  timeout 150 python3 -m benchmarks.disagg_smoke --lengths 2048,8192 --burst 4 --out $D/disagg_smoke_$tag.json > $D/smoke_$tag.log 2>&1; echo "smoke $tag rc=$?"
  tail -4 $D/smoke_$tag.log | cut -c1-250
  grep -hE "backend|Error|Traceback" $D/prefill_$tag.log $D/decode_$tag.log | cut -c1-250 | head -6
  kill $p1 $p2; sleep 2; kill -9 $p1 $p2 2>/dev/null; pkill -9 -f launcher.cli; sleep 1
}
smoke default
smoke fp8attn --fp8-attention on --linear-backend deepgemm
tar czf $OUT/dg15.tgz -C $OUT dg15 && rm -rf $OUT/dg15
