"""CPU throughput of the single-process engine on the tiny model: a regression guard, not a goal.

    python -m benchmarks.cpu_engine [--seqs 16 --prompt 64 --out-tokens 64]
Writes benchmarks/results/cpu_engine.json (or $OUT) with tokens/s for prefill and decode.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import environment
from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/cpu_engine.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(EngineConfig(kv_cache_bytes=64 << 20))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200000, (a.prompt,), generator=g).tolist() for _ in range(a.seqs)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.out_tokens, temperature=0, ignore_eos=True))
    t_all = time.perf_counter() - t0
    n_out = sum(len(o.output_ids) for o in outs)
    res = {"env": environment(), "args": vars(a), "model": "tiny (4 layers, hidden 64, vocab 201088)",
           "prefill_tokens_per_s": a.seqs * a.prompt / t_prefill,
           "generate_tokens_per_s": n_out / max(t_all - t_prefill, 1e-9), "total_seconds": t_all}
    llm.kv.assert_all_free()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"prefill {res['prefill_tokens_per_s']:.0f} tok/s, decode {res['generate_tokens_per_s']:.0f} tok/s "
          f"({a.seqs} seqs x {a.out_tokens} tokens)")


if __name__ == "__main__":
    main()
