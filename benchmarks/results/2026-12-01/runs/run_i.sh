#!/usr/bin/env bash
# GPU run I (two H200s, 2026-12-01): where a NIXL WRITE spends its time (benchmarks/nixl_probe);
# decode all-reduces NCCL vs symmetric-memory one-shot, eager and in CUDA graphs, and 20b TP2 decode
# with each (A/B), 120b TP2 with the one-shot path; multi-rank workers (prefill TP2 + decode TP2 EP
# with CUDA graphs, KV over NIXL) through the wire protocol; dense FP8 GEMM incl. GEMM-only rows.
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/i
timeout ${T_PROBE:-150} python3 -m benchmarks.nixl_probe > $OUT/i/nixl_probe.log 2>&1; echo "probe rc=$?"
grep -v "NIXL INFO\|^{" $OUT/i/nixl_probe.log | tail -32
TP="torchrun --nproc-per-node 2 -m benchmarks.bench_tp --bf16-attention"
timeout ${T_TP20:-200} $TP --preset gpt-oss-20b --moe-mode ep --prefill-lens 8192 --contexts 8192 --batches 1,64,128 > $OUT/i/tp20_nccl.log 2>&1; echo "tp20 nccl rc=$?"
grep -E "^all-reduce|^decode|^prefill" $OUT/i/tp20_nccl.log
timeout ${T_TP20:-200} $TP --preset gpt-oss-20b --moe-mode ep --skip-allreduce --fast-allreduce-kib 1024 --prefill-lens 8192 --contexts 8192 --batches 1,64,128 > $OUT/i/tp20_oneshot.log 2>&1; echo "tp20 oneshot rc=$?"
grep -E "^decode|^prefill|Error" $OUT/i/tp20_oneshot.log | head
timeout ${T_TP120:-240} $TP --preset gpt-oss-120b --moe-mode ep --skip-allreduce --fast-allreduce-kib 1024 --prefill-lens 8192 --contexts 8192 --batches 1,8,64,128 > $OUT/i/tp120_oneshot.log 2>&1; echo "tp120 oneshot rc=$?"
grep -E "^decode|^prefill|Error" $OUT/i/tp120_oneshot.log | head
W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --moe-backend triton --kv-backend nixl --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12 --tp 2"
python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $OUT/i/prefill_tp2.log 2>&1 &
python3 -m launcher.cli decode-worker $W --moe-mode ep --device cuda:0 --port 7200 --cuda-graphs --max-num-seqs 16 > $OUT/i/decode_tp2.log 2>&1 &
timeout ${T_SMOKE:-200} python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 --out $OUT/i/disagg_smoke_tp2.json > $OUT/i/smoke_tp2.log 2>&1; echo "smoke tp2 rc=$?"
tail -6 $OUT/i/smoke_tp2.log
grep -iE "error|Traceback|captured|self-test" $OUT/i/prefill_tp2.log $OUT/i/decode_tp2.log | head -10
kill %1 %2; sleep 3; kill -9 %1 %2 2>/dev/null; pkill -9 -f launcher.cli
CUDA_VISIBLE_DEVICES=0 timeout ${T_GEMM:-120} python3 -m benchmarks.gemm --quick > $OUT/i/gemm.log 2>&1; echo "gemm rc=$?"
grep -E "M=8192|8192 \|" $OUT/i/gemm.log | grep -v FAILED | head -20
mv $OUT/*.json $OUT/i/ 2>/dev/null; rm -f $OUT/.rank*
tar czf $OUT/i.tgz -C $OUT i && rm -rf $OUT/i
