"""Batch-1 decode attention (issue 27): the Triton decode kernel's launch configs for ONE sequence.

The 20b batch-1 profile (issue27-h100-1, H100) spent 226 us a step in `_decode_fwd` (+ 30 us merging splits):
~15 us per full layer for 16.8 MB of bf16 K/V at 8k, ~2.6x that read at copy bandwidth. The kernel's config
was tuned on 64-128 sequences (benchmarks/attention.py's sweep); at one sequence the grid is 8 KV heads x
S splits of one-warp programs, S from `programs_per_sm` (64 at 8k: two 64-key blocks per program). Here
the splits, keys per block and pipeline stages are swept at one sequence, each config timed as CUDA-graph
replays of `paged_decode` (read + split merge) over 6 copies of the layer's pages (no L2 hits between
calls), for bf16 and e4m3 pages at 8k and 32k and a sliding layer (window 128: also 32-key blocks in 1 or 2 splits,
what ONE_SEQ_BF16_DECODE's full-layer blocks would do there); output checked against the
default config's (same math, other split points: ~1e-3). Prints the fastest first per case and writes
$OUT/decode_b1.json.

    python -m benchmarks.decode_b1            # on the GPU
    python -m benchmarks.decode_b1 --cases 8k-sliding   # some cases only (8k, 32k, 8k-sliding)
    python -m benchmarks.decode_b1 --smoke    # tiny shapes on the CPU interpreter (script check)
"""

from __future__ import annotations

import itertools
import json
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from benchmarks.gemm import bench  # noqa: E402
from kernels.triton_attention import AttnBatch  # noqa: E402
from kernels.triton_decode import (  # noqa: E402
    BF16_DECODE, DEFAULT_DECODE, FP8, ONE_SEQ_BF16_DECODE, DecodeConfig, decode_splits, layer_config, paged_decode)

DEV = torch.device("cpu" if SMOKE else "cuda")
HQ, HKV, D, P = (8, 2, 32, 16) if SMOKE else (64, 8, 64, 16)
CASES = ((("8k", 40, None),) if SMOKE else
         (("8k", 8192, None), ("32k", 32768, None), ("8k-sliding", 8192, 128)))
COPIES = 1 if SMOKE else 6


def make(ctx: int, kv_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[tuple], AttnBatch, torch.Tensor]:
    """q [1, Hq, D]; COPIES (k_cache, v_cache) [NP, Hkv, P, D] under one scattered page table."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    pages = -(-ctx // P)
    perm = torch.randperm(pages, generator=g, device=DEV).to(torch.int32)
    table = perm[None, :].contiguous()  # [1, pages]
    caches = []
    for _ in range(COPIES):
        kc, vc = (torch.randn(pages, HKV, P, D, generator=g, device=DEV) for _ in range(2))
        if kv_dtype == FP8:
            kc, vc = (kc * 8).to(FP8), (vc * 8).to(FP8)
        else:
            kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
        caches.append((kc, vc))
    q = torch.randn(1, HQ, D, generator=g, device=DEV).to(torch.float32 if SMOKE else torch.bfloat16)
    batch = AttnBatch.build([1], [ctx], [ctx], table, DEV)
    sinks = torch.randn(HQ, generator=g, device=DEV)
    return q, caches, batch, sinks


def timed(fn, reps: int) -> float:
    """us per call: `reps` calls cycling over the page copies in one CUDA graph (benchmarks.gemm.bench)."""
    if SMOKE:
        fn(0)
        return 0.0
    return 1e3 * bench([lambda i=i: fn(i % COPIES) for i in range(reps)])


def configs() -> list[tuple[DecodeConfig, int | None]]:
    """(config, splits): None = the config's own rule (decode_splits); the defaults first."""
    if SMOKE:
        return [(DEFAULT_DECODE, None), (DecodeConfig(block_n=16, num_stages=2), 2)]
    out: list[tuple[DecodeConfig, int | None]] = [(BF16_DECODE, None), (DEFAULT_DECODE, None),
                                                  (ONE_SEQ_BF16_DECODE, None)]
    for bn, st, s in itertools.product((32, 64, 128), (2, 3, 4), (1, 2, 8, 16, 24, 32, 48, 64)):
        out.append((DecodeConfig(block_n=bn, num_stages=st), s))
    out += [(DecodeConfig(block_n=64, num_warps=2, num_stages=st), s) for st in (2, 3) for s in (16, 32)]
    return out


def main() -> None:
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    sms = 4 if SMOKE else torch.cuda.get_device_properties(DEV).multi_processor_count
    rows = []
    only = sys.argv[sys.argv.index("--cases") + 1].split(",") if "--cases" in sys.argv else None
    cases = [c for c in CASES if only is None or c[0] in only]
    for (name, ctx, window), kv_dtype in itertools.product(cases, (torch.bfloat16, FP8)):
        if SMOKE:
            kv_dtype = torch.float32 if kv_dtype == torch.bfloat16 else kv_dtype
        q, caches, batch, sinks = make(ctx, kv_dtype, seed=ctx)
        scales = (torch.ones(HKV, device=DEV) * 0.125, torch.ones(HKV, device=DEV) * 0.125) if kv_dtype == FP8 else None
        kv_bytes = batch.kv_lens[0] if window is None else min(window, ctx)
        kv_bytes *= 2 * HKV * D * caches[0][0].element_size()
        want = None
        case = f"{name}-{str(kv_dtype).removeprefix('torch.')}"
        for cfg, splits in configs():
            s = splits or decode_splits(batch, HKV, window, layer_config(cfg, window), sms)
            if window is not None and splits is not None and (splits > 2 or cfg.block_n > 64 or cfg.num_stages > 3):
                continue  # a 128-key window has 1-4 blocks: the rule's split (1) and 2, short pipelines
            if window is None and splits is not None and splits < 8:
                continue  # 1-2 splits: the sliding layer's, far too few programs for 8k keys

            def fn(i: int, cfg=cfg, s=s) -> torch.Tensor:
                return paged_decode(q, caches[i], batch, sinks, D ** -0.5, window, kv_scale=scales, config=cfg,
                                    num_splits=s)
            try:
                got = fn(0).float()
                us = timed(fn, reps=24)
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory: report, go on
                print(f"{case} {cfg} S={s}: {type(err).__name__}: {str(err)[:100]}", flush=True)
                continue
            if want is None:
                want = got
            rel = float((got - want).norm() / want.norm())
            rows.append({"case": case, "block_n": layer_config(cfg, window).block_n, "warps": cfg.num_warps,
                         "stages": cfg.num_stages,
                         "splits": s, "rule": splits is None, "us": us, "GBps": kv_bytes / us / 1e3 if us else 0.0,
                         "rel_vs_first": rel})
        caches.clear()  # the next case's pages
    with open(os.path.join(out_dir, "decode_b1.json"), "w") as f:
        json.dump({"device": "cpu" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        rule = [r for r in mine if r["rule"]]
        print(f"\n{case}: the rule's configs " + ", ".join(
            f"bn{r['block_n']}/st{r['stages']}/S{r['splits']} {r['us']:.2f} us" for r in rule))
        for r in sorted(mine, key=lambda r: r["us"])[:8]:
            print(f"b1 {case:22s} bn {r['block_n']:3d} warps {r['warps']} stages {r['stages']} S {r['splits']:2d}"
                  f"{' (rule)' if r['rule'] else '       '}  {r['us']:7.2f} us  {r['GBps']:6.0f} GB/s  "
                  f"rel {r['rel_vs_first']:.1e}", flush=True)
    bad = [r for r in rows if r["rel_vs_first"] > 2e-2]
    print(f"done: {len(rows)} configs timed, {len(bad)} off the first config's output by > 2e-2")


if __name__ == "__main__":
    main()
