#!/usr/bin/env bash
# GPU run J2 (two H200s): what issues #6 and #7 still need from the 2-GPU machine, in one call that
# fits ~9 minutes (the session's remaining device time); each step has its own timeout.
#  1. our one-shot all-reduce: bit-exact on two GPUs (eager, repeated, CUDA-graph replays)
#  2. all-reduce latency per decode-sized message: NCCL, torch one-/two-shot, ours (bench_tp)
#  3. 20b TP2 MoE-EP decode at 8k context: torch's one-shot vs ours, and ours + vocab-parallel lm_head
#  4. KV transfer GPU0 -> GPU1, 120b-shaped, 8k and 32k: copy_ p2p, NIXL, IPC data path; overlap
#  5. multi-rank disaggregated serving (prefill TP2 + decode TP2, both MoE-EP), KV over the IPC data
#     path: greedy tokens must equal colocated, every page back
#  6. 2-GPU tests (all-reduce, IPC KV transfer)
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/j2
timeout ${T_AR1:-60} python3 -m scripts.gpu.diag_ar1 > $OUT/j2/diag_ar1.log 2>&1; echo "ar1 rc=$?"; tail -10 $OUT/j2/diag_ar1.log
TP="torchrun --nproc-per-node 2 -m benchmarks.bench_tp --bf16-attention --preset gpt-oss-20b --moe-mode ep"
timeout ${T_AR:-60} $TP --prefill-lens "" --contexts "" > $OUT/j2/allreduce.log 2>&1; echo "ar rc=$?"
grep -E "^all-reduce|Error" $OUT/j2/allreduce.log | head -12
tp20() {  # $1 = tag, rest = flags
  timeout ${T_TP20:-75} $TP --skip-allreduce --prefill-lens "" --contexts 8192 --batches 1,128 "${@:2}" > $OUT/j2/tp20_$1.log 2>&1; echo "tp20 $1 rc=$?"
  grep -E "^decode|Error" $OUT/j2/tp20_$1.log | head -4
}
tp20 torchar
tp20 tandemar --fast-allreduce-impl tandem
tp20 tandemar_vocab --fast-allreduce-impl tandem --vocab-parallel
timeout ${T_KV:-110} python3 -m benchmarks.kv_transfer --iters 2 --placements contig scattered > $OUT/j2/kv_transfer.log 2>&1; echo "kv rc=$?"
grep -v "NIXL INFO" $OUT/j2/kv_transfer.log | tail -22
W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --moe-backend triton --kv-backend ipc --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12 --tp 2 --moe-mode ep"
python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $OUT/j2/prefill.log 2>&1 &
python3 -m launcher.cli decode-worker $W --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $OUT/j2/decode.log 2>&1 &
timeout ${T_SMOKE:-110} python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 --out $OUT/j2/disagg_smoke_ipc.json > $OUT/j2/smoke.log 2>&1; echo "smoke rc=$?"
tail -6 $OUT/j2/smoke.log
grep -iE "error|Traceback|data path" $OUT/j2/prefill.log $OUT/j2/decode.log | head -6
kill %1 %2; sleep 2; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli; sleep 1
timeout ${T_TESTS:-90} python3 -m pytest -q -m gpu tests/kernels/test_allreduce.py tests/integration/test_kv_transfer_ipc_gpu.py > $OUT/j2/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -4 $OUT/j2/gpu_tests.log
mv $OUT/*.json $OUT/j2/ 2>/dev/null; rm -f $OUT/.rank*
tar czf $OUT/j2.tgz -C $OUT j2 && rm -rf $OUT/j2
