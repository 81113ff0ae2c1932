"""n > 1 on the CPU stack (tiny random model): prompt tokens computed and KV bytes shipped for one
203-token prompt with n = 1 and n = 4 (temperature 1, seed 1, 8 output tokens), disaggregated and
colocated. Run from the repository root: .venv/bin/python benchmarks/results/2026-12-02/cpu-grammar-1/n_share.py"""
import sys
import time

import httpx

sys.path.insert(0, ".")
from tests.support.service import start_service  # noqa: E402
from engine.build import DEFAULT_CACHE  # noqa: E402
from model.checkpoint_io import ensure_checkpoint  # noqa: E402

ckpt = str(ensure_checkpoint("tiny", DEFAULT_CACHE))  # the random tiny checkpoint the e2e tests use
for colocated in (False, True):
    svc = start_service(ckpt, colocated=colocated)
    try:
        prompt = list(range(1000, 1203))
        for n in (1, 4):
            t = time.time()
            r = httpx.post(svc.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8, "n": n,
                                                               "temperature": 1.0, "seed": 1}, timeout=300).json()
            u = r["usage"]
            print("colocated" if colocated else "disaggregated", f"n={n}", "prompt_tokens", u["prompt_tokens"],
                  "computed", u["tandem"]["computed_tokens"], "cached", u["prompt_tokens_details"]["cached_tokens"],
                  "kv_bytes_shipped", u["tandem"]["kv_bytes_shipped"], f"{time.time() - t:.2f} s", flush=True)
            prompt = [p + 1 for p in prompt]  # a fresh prompt for the next n
    finally:
        svc.stop()
