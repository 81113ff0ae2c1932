"""Tune the Triton MoE tiles for gpt-oss (hidden = intermediate = 2880, top-4) on an H200, within a
time budget (default 165 s, compile time included). Writes $OUT/moe.json in kernels/tuning's
format: copy it over kernels/tuning/moe.json to use it.

    python -m benchmarks.tune_moe [--budget 165] [--no-bf16]

Per bucket of routed rows per expert (M = T * 4 / E), on 20b-shaped experts (E = 32): for each
candidate BLOCK_M, gate_up and down are timed separately (CUDA-graph replay, distinct logit sets
rotating the touched experts out of L2 at decode), the best of each is kept and the BLOCK_M with
the smallest sum wins. gate_up candidates with 128-wide tiles include the separate activation
quantisation pass they need; decode buckets also try split-K (2, 4). Buckets not reached within
the budget keep the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import product

import torch

from benchmarks.gemm import Report, bench, environment
from benchmarks.moe import H, I, TOP_K, logit_sets, make_experts
from kernels.tuning import MoEConfig, TileConfig, default_moe_config, nearest_bucket

DEVICE = "cuda"  # a module constant so a CPU smoke run can swap it
E = 32
BUCKETS = [1, 4, 16, 64, 256, 1024]


def tokens_for(bucket: int) -> int:
    return 1 if bucket == 1 else bucket * E // TOP_K  # bucket 1: batch-1 decode


def bm_candidates(bucket: int) -> list[int]:
    """Row tiles worth trying for M routed rows per expert (any M: the buckets between the shipped ones
    too, e.g. 8 = a 64-token decode step, 48 = a 384-token piecewise bucket)."""
    mid = [16, 32, 64] if MID16 else [32, 64]
    return [16] if bucket <= 4 else [16, 32] if bucket <= 16 else mid if bucket <= 64 else [64, 128]


WIDE = False  # --wide: buckets >= WIDE_FROM also try 4 stages, 4/8 warps and 256-wide tiles (64-row only)
TMA = False  # --tma: with --wide, FP8 weight tiles by TMA descriptors (kernels/moe.py expert_gemm_tma)
WIDE_FROM = 64  # --wide-from: the smallest bucket the wide space applies to
# --mid16: 16-row tiles for the mid buckets (M = 17-64) too, with --wide streaming the weights as decode does: deeper
# pipelines (6 stages of 34 KB) and split-K 2. moe-tune-mid16-1 (H100): 26-30 % slower than 32/64-row tiles at
# M = 32, 48, 64 (each expert's weights read by 3-4 row tiles), so off unless asked for.
MID16 = False


def tile_candidates(bm: int, bucket: int, fp8: bool, gemm: int) -> list[TileConfig]:
    bk = 128 if fp8 else 64
    if WIDE and bucket >= WIDE_FROM:
        group = 8 if bucket > 64 else 1
        tma = TMA and fp8
        mid16 = bm <= 16 and bucket <= 64  # only with --mid16 (MID16)
        return [TileConfig(bm, bn, bk, group, w, s, sk, tma=tma)
                for bn, w, s, sk in product([128, 256], [4, 8], [3, 4, 6] if mid16 else [3, 4], [1, 2] if mid16 else [1])
                if not (bm >= 128 and (w == 4 or bn == 256))]  # 128 x 256 spills (ptxas)
    decode = bucket <= 4  # bandwidth-bound, few tiles: split K over more CTAs (kernels/moe.py)
    if gemm == 1:
        widths = [256, 128] if fp8 else [128, 256]
    else:
        widths = [32, 64, 128] if decode else [64, 128, 256]
    if fp8 and bm >= 128:  # two fp32 accumulators: a 64 x 256 warpgroup tile would spill
        widths = [wd for wd in widths if wd <= 128]
    warps = [4] if bm <= 32 else [8] if bm >= 128 else [4, 8]
    stages = [3, 4] if bm <= 32 else [3]
    splits = [1, 2, 4] if decode else [1]
    group = 1 if bucket <= 64 else 8
    return [TileConfig(bm, bn, bk, group, w, s, sk) for bn, w, s, sk in product(widths, warps, stages, splits)]


class Tuner:
    def __init__(self, budget_s: float, rep: Report) -> None:
        self.deadline = time.time() + budget_s
        self.rep = rep
        self.log: list[dict] = []

    def out_of_time(self) -> bool:
        return time.time() > self.deadline

    def tune_bucket(self, w, bucket: int, fp8: bool, base: MoEConfig | None = None) -> MoEConfig | None:
        """The bucket's best MoEConfig; `base` (the table's entry now) is timed first on the same
        inputs, so the log holds the before and the after of one process."""
        from kernels import moe as m
        from kernels.fp8_quant import quantize_act_1x128
        from kernels.moe_align import route_topk_softmax
        t = tokens_for(bucket)
        gen = torch.Generator(device=DEVICE).manual_seed(bucket)
        x = torch.randn(t, H, device=DEVICE, generator=gen).to(torch.bfloat16)
        routes = [route_topk_softmax(lg, TOP_K) for lg in logit_sets(t, E, gen)]
        xq, xs = quantize_act_1x128(x) if fp8 else (x, None)
        best: tuple[float, MoEConfig] | None = None
        ctx = (m, quantize_act_1x128, xq, xs, w, routes)
        if base is not None:  # timed whatever the budget says: the before of this bucket's A/B
            r = self._pair(ctx, base.block_m, bucket, fp8, ([base.gemm1], [base.gemm2]), budget=False)
            if r is not None:
                (t1, _), (t2, _) = r
                self.log.append({"fp8": fp8, "bucket": bucket, "T": t, "block_m": base.block_m, "base": True,
                                 "gate_up_ms": t1, "down_ms": t2, "gemm1": base.gemm1.to_json(),
                                 "gemm2": base.gemm2.to_json()})
                best = (t1 + t2, base)
        for bm in bm_candidates(bucket):
            r = self._pair(ctx, bm, bucket, fp8)
            if r is None:
                continue
            (t1, g1), (t2, g2) = r
            self.log.append({"fp8": fp8, "bucket": bucket, "T": t, "block_m": bm, "gate_up_ms": t1,
                             "down_ms": t2, "gemm1": g1.to_json(), "gemm2": g2.to_json()})
            if best is None or t1 + t2 < best[0]:
                best = (t1 + t2, MoEConfig(bm, g1, g2))
        return best[1] if best else None

    def _pair(self, ctx, bm: int, bucket: int, fp8: bool, candidates=(None, None), budget: bool = True):
        """The fastest gate_up tile, then the fastest down tile on its output, for row tiles of bm (among
        `candidates` per GEMM, default the bucket's space): ((ms, tile), (ms, tile)) or None."""
        from kernels.moe_align import align_by_expert
        m, quant, xq, xs, w, routes = ctx
        groups = [align_by_expert(ids, 0, E, bm) for _, ids in routes]
        t1 = self._best(bm, bucket, fp8, 1, groups, lambda c, s: self._acts(m, quant, xq, xs, w, groups[s], c, fp8),
                        candidates[0], budget)
        if t1 is None:
            return None
        # down's input per logit set (any gate_up tile gives the same values)
        acts = [self._acts(m, quant, xq, xs, w, g, t1[1], fp8) for g in groups]
        t2 = self._best(bm, bucket, fp8, 2, groups,
                        lambda c, s: m.down(*acts[s], w, groups[s], routes[s][0], c, torch.bfloat16),
                        candidates[1], budget)
        return None if t2 is None else (t1, t2)

    @staticmethod
    def _acts(m, quant, xq, xs, w, g, cfg: TileConfig, fp8: bool):
        """gate_up's output; with 128-wide FP8 tiles the separate re-quantisation belongs to its cost."""
        act, acts = m.gate_up(xq, xs, w, g, TOP_K, cfg, torch.bfloat16)
        return quant(act) if fp8 and acts is None else (act, acts)

    def _best(self, bm: int, bucket: int, fp8: bool, gemm: int, groups, run, candidates=None,
              budget: bool = True) -> tuple[float, TileConfig] | None:
        """Fastest tile for one GEMM among `candidates` (default: the bucket's space): `run(cfg, s)` launches
        it on logit set s. budget=False times them even past the deadline."""
        best = None
        for cfg in candidates or tile_candidates(bm, bucket, fp8, gemm):
            if budget and self.out_of_time():
                break
            try:
                ms = bench([lambda s=s: run(cfg, s) for s in range(len(groups))], trials=3, min_ms=5)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip this tile
                self.rep.errors.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        return best


def main() -> None:
    global WIDE, TMA, WIDE_FROM, MID16
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=165.0, help="seconds, compile time included")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                    help="tune only these; the others keep their entries from --base")
    ap.add_argument("--base", default=None, help="a tuned table (e.g. kernels/tuning/moe.json) to start from")
    ap.add_argument("--wide", action="store_true", help="a wider tile space for the prefill buckets")
    ap.add_argument("--tma", action="store_true", help="with --wide: FP8 weight tiles by TMA")
    ap.add_argument("--wide-from", type=int, default=WIDE_FROM, help="the smallest bucket --wide applies to")
    ap.add_argument("--mid16", action="store_true", help="16-row tiles for buckets 17-64 too (measured slower: MID16)")
    args = ap.parse_args()
    WIDE, TMA, WIDE_FROM, MID16 = args.wide, args.tma, args.wide_from, args.mid16
    buckets = [int(b) for b in args.buckets.split(",")]
    base = json.loads(open(args.base).read()) if args.base else {}
    rep = Report("moe_tuning")
    rep.data["env"] = rep.section("environment", environment)
    tuner = Tuner(args.budget, rep)
    fp8_w, bf16_w = make_experts(E, seed=3)
    table: dict = {"_meta": {"tuned": True, "device": (rep.data["env"] or {}).get("device"),
                             "date": time.strftime("%Y-%m-%d"), "env": rep.data["env"],
                             "m": "routed rows per expert = ceil(T * top_k / E)",
                             "buckets_tuned_this_run": buckets, "other_buckets_from": args.base}}
    table.update({k: v for k, v in base.items() if k != "_meta"})  # kinds not tuned now stay as they were
    kinds = [(True, fp8_w)] + ([] if args.no_bf16 else [(False, bf16_w)])
    for fp8, w in kinds:
        key = f"{'fp8' if fp8 else 'bf16'}_N{2 * I}_K{H}"
        entries = dict(base.get(key, {}))
        shipped = {int(b): e for b, e in entries.items()}  # what the workers pick today, by nearest bucket
        for bucket in buckets:
            old = nearest_bucket(shipped, bucket) if shipped else None
            old_cfg = MoEConfig.from_json(old) if old else None
            cfg = rep.section(f"{key} bucket {bucket}", lambda: tuner.tune_bucket(w, bucket, fp8, old_cfg))
            tuned = cfg is not None
            entries[str(bucket)] = (cfg or default_moe_config(bucket, fp8)).to_json() | {"tuned": tuned}
        if str(BUCKETS[-1]) in entries:
            entries["4096"] = dict(entries[str(BUCKETS[-1])])  # beyond 8k tokens (20b) the largest carries over
        table[key] = entries
    rep.data["table"] = table
    rep.data["log"] = tuner.log
    out = rep.write().parent / "moe.json"
    out.write_text(json.dumps(table, indent=1))
    print(f"tuned table: {out}")
    for row in tuner.log:
        print(row)
    sys.exit(0)


if __name__ == "__main__":
    main()
