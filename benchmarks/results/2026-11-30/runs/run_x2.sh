#!/usr/bin/env bash
# GPU run C (two H200s): real-dims parity vs HF (GPU 0), NIXL KV transfer GPU0 -> GPU1, and the TP2
# model benchmarks (120b and 20b, EP-with-TP-combine MoE, all-reduce latencies).
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/x
CUDA_VISIBLE_DEVICES=0 timeout ${T_PARITY:-100} python3 -m benchmarks.parity_real > $OUT/x/parity.log 2>&1; echo "parity rc=$?"
tail -4 $OUT/x/parity.log
timeout ${T_KV:-150} python3 -m benchmarks.kv_transfer --iters 3 > $OUT/x/kv_transfer.log 2>&1; echo "kv rc=$?"
tail -14 $OUT/x/kv_transfer.log
timeout ${T_TP120:-240} torchrun --nproc-per-node 2 -m benchmarks.bench_tp --preset gpt-oss-120b --moe-mode ep > $OUT/x/tp_120b.log 2>&1; echo "tp120 rc=$?"
grep -E "^\|" $OUT/x/tp_120b.log | tail -30
timeout ${T_TP20:-80} torchrun --nproc-per-node 2 -m benchmarks.bench_tp --preset gpt-oss-20b --moe-mode ep --skip-allreduce --prefill-lens 8192 --contexts 8192 --batches 1,64 > $OUT/x/tp_20b.log 2>&1; echo "tp20 rc=$?"
grep -E "^\|" $OUT/x/tp_20b.log | tail -12
mv $OUT/*.json $OUT/x/ 2>/dev/null
tar czf $OUT/x2.tgz -C $OUT x && rm -rf $OUT/x
