#!/usr/bin/env bash
# GPU run D (one H200): fp32 parity at real widths (few layers) vs HF, and the 20b decode at 32k.
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    t.extractall(env.FLASHINFER_AOT_DIR, members=[m for m in t.getmembers() if m.name.endswith(".so")], filter="data")
PY
mkdir -p $OUT/d
timeout ${T_PARITY:-150} python3 -m benchmarks.parity_real --skip-full --fp32-layers 2 --attention flashinfer > $OUT/d/parity_fp32.log 2>&1; echo "parity rc=$?"
grep -E "real widths|Error|error" $OUT/d/parity_fp32.log | tail -8
timeout ${T_MODEL:-260} python3 -m benchmarks.bench_model --preset gpt-oss-20b --prefill-lens "" --contexts 32768 --batches 1,8,64,128 --tag gpt-oss-20b-tp1-32k > $OUT/d/model32k.log 2>&1; echo "model rc=$?"
grep -E "^decode|FAILED|^\|" $OUT/d/model32k.log | tail -12
mv $OUT/*.json $OUT/d/ 2>/dev/null
tar czf $OUT/d.tgz -C $OUT d && rm -rf $OUT/d
