#!/usr/bin/env bash
# GPU run N (one H200, 2026-12-01): RoPE of Q and K as one Triton launch each inside the model
# (was ~18 elementwise kernels per layer): kernel exactness tests, real-width parity vs HF, and the
# 20b decode step (compare run L).
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
PY
mkdir -p $OUT/n
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention_gpu.py -k "rope or store or engine_tokens or cuda_graph" -p no:cacheprovider > $OUT/n/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -3 $OUT/n/gpu_tests.log
timeout 150 python3 -m benchmarks.parity_real > $OUT/n/parity.log 2>&1; echo "parity rc=$?"; tail -4 $OUT/n/parity.log
timeout 240 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192 --batches 1,32,128 --tag n > $OUT/n/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/n/model.log | head
mv $OUT/*.json $OUT/n/ 2>/dev/null
tar czf $OUT/n.tgz -C $OUT n && rm -rf $OUT/n
