#!/usr/bin/env bash
# GPU run E (two H200s): disaggregated serving on GPUs through the wire protocol (prefill worker on
# GPU 0, decode worker with CUDA graphs on GPU 1, KV over NIXL VRAM -> VRAM), then 120b TP2 prefill
# with TP-sliced experts.
WHL=.whl-nixl source scripts/gpu/env.sh
mkdir -p $OUT/e
W="--random-weights gpt-oss-20b --fp8 --attention-backend triton --moe-backend triton --linear-backend scaled_mm --kv-backend nixl --metrics-port 0 --host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 16"
python3 -m launcher.cli prefill-worker $W --device cuda:0 --port 7100 > $OUT/e/prefill.log 2>&1 &
python3 -m launcher.cli decode-worker $W --device cuda:1 --port 7200 --cuda-graphs --max-num-seqs 16 > $OUT/e/decode.log 2>&1 &
timeout ${T_SMOKE:-300} python3 -m benchmarks.disagg_smoke --lengths 512,2048,8192 --burst 8 > $OUT/e/smoke.log 2>&1; echo "smoke rc=$?"
tail -6 $OUT/e/smoke.log
grep -iE "error|Traceback|captured|self-test" $OUT/e/prefill.log $OUT/e/decode.log | head -10
kill %1 %2; sleep 3; kill -9 %1 %2 2>/dev/null
timeout ${T_TP:-150} torchrun --nproc-per-node 2 -m benchmarks.bench_tp --preset gpt-oss-120b --moe-mode tp --skip-allreduce --prefill-lens 8192,32768 --contexts "" > $OUT/e/tp_120b_tpmoe.log 2>&1; echo "tp rc=$?"
grep -E "^\|" $OUT/e/tp_120b_tpmoe.log | tail -6
mv $OUT/*.json $OUT/e/ 2>/dev/null; rm -f $OUT/.rank*
tar czf $OUT/e.tgz -C $OUT e && rm -rf $OUT/e
