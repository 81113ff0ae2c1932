#!/usr/bin/env bash
# GPU run J (two H200s, 2026-12-01): KV transfer with the batched-WRITE sender (overlap per page
# placement); all-reduce paths incl. two-shot; multi-rank disaggregated serving with the same MoE
# layout on both roles (tokens must equal colocated) and with prefill TP-sliced / decode EP; the
# same-node SM-driven alternative to NIXL (benchmarks/ipc_copy.py).
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/j
timeout ${T_KV:-200} python3 -m benchmarks.kv_transfer --iters 3 > $OUT/j/kv_transfer.log 2>&1; echo "kv rc=$?"
grep -v "NIXL INFO" $OUT/j/kv_transfer.log | tail -22
timeout ${T_IPC:-150} python3 -m benchmarks.ipc_copy --iters 3 > $OUT/j/ipc_copy.log 2>&1; echo "ipc rc=$?"
grep -E "^(kernel|staged|ERROR)|method" $OUT/j/ipc_copy.log | tail -14
timeout ${T_AR:-120} torchrun --nproc-per-node 2 -m benchmarks.bench_tp --bf16-attention --preset gpt-oss-20b --moe-mode ep --prefill-lens "" --contexts "" > $OUT/j/allreduce.log 2>&1; echo "ar rc=$?"
grep -E "^all-reduce" $OUT/j/allreduce.log
smoke() {  # $1 = tag, $2 = prefill MoE mode
  W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --moe-backend triton --kv-backend nixl --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12 --tp 2"
  python3 -m launcher.cli prefill-worker $W --moe-mode $2 --device cuda:0 --port 7100 > $OUT/j/prefill_$1.log 2>&1 &
  python3 -m launcher.cli decode-worker $W --moe-mode ep --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $OUT/j/decode_$1.log 2>&1 &
  timeout ${T_SMOKE:-150} python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 --out $OUT/j/disagg_smoke_$1.json > $OUT/j/smoke_$1.log 2>&1; echo "smoke $1 rc=$?"
  tail -5 $OUT/j/smoke_$1.log
  grep -iE "error|Traceback" $OUT/j/prefill_$1.log $OUT/j/decode_$1.log | head -5
  kill %1 %2; sleep 3; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli; sleep 1
}
smoke tp2ep ep
smoke tp2tp tp
mv $OUT/*.json $OUT/j/ 2>/dev/null; rm -f $OUT/.rank*
tar czf $OUT/j.tgz -C $OUT j && rm -rf $OUT/j
