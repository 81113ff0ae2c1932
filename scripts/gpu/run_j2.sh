#!/usr/bin/env bash
# GPU run J2 (two H200s): everything issues #6 and #7 still need from the 2-GPU machine, in one call.
#  1. our one-shot all-reduce: bit-exact on two GPUs (eager, repeated, CUDA-graph replays)
#  2. all-reduce latency per decode-sized message: NCCL, torch one-/two-shot, ours (bench_tp)
#  3. 20b TP2 MoE-EP decode: torch's one-shot vs ours, and ours + vocab-parallel lm_head (step times)
#  4. KV transfer GPU0 -> GPU1, 120b-shaped, 8k and 32k: copy_ p2p, NIXL, IPC data path; overlap
#  5. multi-rank disaggregated serving, same MoE layout on both roles (tokens must equal colocated),
#     KV over NIXL and over the IPC data path
#  6. 2-GPU tests (all-reduce, KV transfer)
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/j2
timeout ${T_AR1:-120} python3 -m scripts.gpu.diag_ar1 > $OUT/j2/diag_ar1.log 2>&1; echo "ar1 rc=$?"; tail -10 $OUT/j2/diag_ar1.log
TP="torchrun --nproc-per-node 2 -m benchmarks.bench_tp --bf16-attention --preset gpt-oss-20b --moe-mode ep"
timeout ${T_AR:-150} $TP --prefill-lens "" --contexts "" > $OUT/j2/allreduce.log 2>&1; echo "ar rc=$?"
grep -E "^all-reduce|Error" $OUT/j2/allreduce.log | head -12
tp20() {  # $1 = tag, rest = flags: 20b TP2 EP decode at 8k context, A/B in one session
  timeout ${T_TP20:-200} $TP --skip-allreduce --contexts 8192 --batches 1,64,128 "${@:2}" > $OUT/j2/tp20_$1.log 2>&1; echo "tp20 $1 rc=$?"
  grep -E "^decode|^prefill|Error" $OUT/j2/tp20_$1.log | head -6
}
tp20 torchar --prefill-lens 8192
tp20 tandemar --prefill-lens "" --fast-allreduce-impl tandem
tp20 tandemar_vocab --prefill-lens "" --fast-allreduce-impl tandem --vocab-parallel
timeout ${T_KV:-300} python3 -m benchmarks.kv_transfer --iters 3 > $OUT/j2/kv_transfer.log 2>&1; echo "kv rc=$?"
grep -v "NIXL INFO" $OUT/j2/kv_transfer.log | tail -30
smoke() {  # $1 = tag, $2 = KV backend
  W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --moe-backend triton --kv-backend $2 --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12 --tp 2 --moe-mode ep"
  python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $OUT/j2/prefill_$1.log 2>&1 &
  python3 -m launcher.cli decode-worker $W --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $OUT/j2/decode_$1.log 2>&1 &
  timeout ${T_SMOKE:-180} python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 --out $OUT/j2/disagg_smoke_$1.json > $OUT/j2/smoke_$1.log 2>&1; echo "smoke $1 rc=$?"
  tail -6 $OUT/j2/smoke_$1.log
  grep -iE "error|Traceback|data path" $OUT/j2/prefill_$1.log $OUT/j2/decode_$1.log | head -6
  kill %1 %2; sleep 3; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli; sleep 1
}
smoke tp2ep_nixl nixl
smoke tp2ep_ipc ipc
timeout ${T_TESTS:-200} python3 -m pytest -q -m gpu tests/kernels/test_allreduce.py tests/integration/test_kv_transfer_ipc_gpu.py > $OUT/j2/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/j2/gpu_tests.log
mv $OUT/*.json $OUT/j2/ 2>/dev/null; rm -f $OUT/.rank*
tar czf $OUT/j2.tgz -C $OUT j2 && rm -rf $OUT/j2
