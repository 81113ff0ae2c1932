#!/usr/bin/env bash
# GPU run B (one H200): tune the MoE tiles (written into the tree for this run), then the 20b model
# benchmark (prefill, decode with CUDA graphs, HF transformers peer). FlashInfer modules built by
# run A come back as AOT modules from .cache/fi (no JIT rebuild).
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
print("restored", len(so), "FlashInfer modules")
PY
mkdir -p $OUT/m
if [ "${TUNE:-1}" = 1 ]; then
  timeout 200 python3 -m benchmarks.tune_moe --budget ${TUNE_BUDGET:-150} > $OUT/m/tune.log 2>&1; echo "tune rc=$?"
  tail -5 $OUT/m/tune.log
  [ -s $OUT/moe.json ] && cp $OUT/moe.json kernels/tuning/moe.json && mv $OUT/moe.json $OUT/m/moe_tuned.json
fi
timeout ${T_MODEL:-400} python3 -m benchmarks.bench_model --preset gpt-oss-20b --hf-peer ${MODEL_ARGS:-} > $OUT/m/model.log 2>&1
echo "model rc=$?"
grep -v "^\s*$" $OUT/m/model.log | tail -45
mv $OUT/*.json $OUT/m/ 2>/dev/null
tar czf $OUT/model.tgz -C $OUT m && rm -rf $OUT/m
