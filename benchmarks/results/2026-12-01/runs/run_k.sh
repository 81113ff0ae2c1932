#!/usr/bin/env bash
# GPU run K (one H200, 2026-12-01): re-tune the decode buckets (1, 4 routed rows per expert) of the
# FP8 MoE with narrower gate_up tiles and deeper pipelines (other buckets kept from the committed
# table), then the MoE kernel benchmark and the 20b model's decode with the new table.
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
print("restored", len(so), "FlashInfer modules")
PY
mkdir -p $OUT/k
timeout 200 python3 -m benchmarks.tune_moe --budget ${TUNE_BUDGET:-140} --no-bf16 --buckets 1,4 --base kernels/tuning/moe.json > $OUT/k/tune.log 2>&1; echo "tune rc=$?"
grep -E "bucket|'bucket'" $OUT/k/tune.log | tail -30
[ -s $OUT/moe.json ] && cp $OUT/moe.json kernels/tuning/moe.json && mv $OUT/moe.json $OUT/k/moe_tuned.json
timeout 150 python3 -m benchmarks.moe --quick > $OUT/k/moe.log 2>&1; echo "moe rc=$?"
grep -E "triton_fp8|expert GEMMs|breakdown|targets" $OUT/k/moe.log | head -20
timeout 200 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,32,128 --tag k > $OUT/k/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill" $OUT/k/model.log
mv $OUT/*.json $OUT/k/ 2>/dev/null
tar czf $OUT/k.tgz -C $OUT k && rm -rf $OUT/k
