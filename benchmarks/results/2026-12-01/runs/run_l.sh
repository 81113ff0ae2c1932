#!/usr/bin/env bash
# GPU run L (one H200, 2026-12-01): 20b decode step time after FlashInfer's plan takes the flat page
# list from the step metadata (one copy) instead of a per-page Python gather; compare run K.
source scripts/gpu/env.sh
python3 - <<'PY'
import tarfile
from flashinfer.jit import env
with tarfile.open(".cache/fi/flashinfer-cache.tar.xz") as t:
    so = [m for m in t.getmembers() if m.name.endswith(".so")]
    t.extractall(env.FLASHINFER_AOT_DIR, members=so, filter="data")
print("restored", len(so), "FlashInfer modules")
PY
mkdir -p $OUT/l
timeout 300 python3 -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 --contexts 8192,32768 --batches 1,32,128 --tag l > $OUT/l/model.log 2>&1; echo "model rc=$?"
grep -E "^decode|^prefill|Error|error" $OUT/l/model.log | head -20
python3 - > $OUT/l/prepare_profile.txt 2>&1 <<'PY'
# where the host time of one batch-128 x 8k decode step goes (cProfile of prepare only)
import cProfile, pstats, torch
from benchmarks.model_setup import build
from benchmarks.model_setup import decode_state
from model.context import SeqStep
from model.kv_cache import SeqPages
from decode_worker.runner import CudaGraphDecoder
model = build("gpt-oss-20b", "flashinfer", "scaled_mm", "triton", fp8_attention=False)
b, ctx = 128, 8192
spec, pool, kv = decode_state(model, ctx + 32, b)
seqs = []
for _ in range(b):
    p = SeqPages(); kv.grow(p, ctx + 1); seqs.append(p)
steps = [SeqStep(p, ctx, 1) for p in seqs]
ids = torch.zeros(b, dtype=torch.long, device="cuda")
r = CudaGraphDecoder(model, pool, kv, b, ctx + 64, buckets=(b,)); r.capture()
for _ in range(3): r.prepare(ids, steps)
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(20): r.prepare(ids, steps)
torch.cuda.synchronize(); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
PY
echo "profile rc=$?"; grep -E "function calls|prepare|plan|build_step_meta" $OUT/l/prepare_profile.txt | head -12
mv $OUT/*.json $OUT/l/ 2>/dev/null
tar czf $OUT/l.tgz -C $OUT l && rm -rf $OUT/l
