#!/usr/bin/env bash
# GPU run M (one H200, 2026-12-01): where a 20b decode step goes now (worker defaults: bf16 QKV/O,
# fused norms), batch 1 and 64 at 8k, kernels and the ops that launch them.
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
PY
mkdir -p $OUT/m
timeout 240 python3 -m benchmarks.profile_decode --preset gpt-oss-20b > $OUT/m/profile.log 2>&1; echo "profile rc=$?"
grep -E "CUDA kernels per step|Self CUDA time total" $OUT/m/profile.log
mv $OUT/profile_decode_b*.txt $OUT/m/ 2>/dev/null
tar czf $OUT/m.tgz -C $OUT m && rm -rf $OUT/m
