#!/usr/bin/env bash
# GPU run O (one H200, 2026-12-01): split-K for the decode MoE GEMMs. Re-tune the decode buckets
# (1, 4 routed rows per expert) with split_k in {1, 2, 4}, then GPU MoE parity at real dims with the
# new table, the MoE kernel benchmark, and the 20b decode step (compare runs L/N).
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
PY
mkdir -p $OUT/o
timeout 210 python3 -m benchmarks.tune_moe --budget ${TUNE_BUDGET:-170} --no-bf16 --buckets 1,4 --base kernels/tuning/moe.json > $OUT/o/tune.log 2>&1; echo "tune rc=$?"
grep -E "^\{" $OUT/o/tune.log | tail -8
[ -s $OUT/moe.json ] && cp $OUT/moe.json kernels/tuning/moe.json && mv $OUT/moe.json $OUT/o/moe_tuned.json
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_gemm_moe_gpu.py -k "moe" -p no:cacheprovider > $OUT/o/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/o/gpu_tests.log
timeout 120 python3 -m benchmarks.moe --quick > $OUT/o/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8|expert GEMMs|breakdown|targets" $OUT/o/moe.log | head -12
timeout 200 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,32,128 --tag o > $OUT/o/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/o/model.log | head
mv $OUT/*.json $OUT/o/ 2>/dev/null
tar czf $OUT/o.tgz -C $OUT o && rm -rf $OUT/o
