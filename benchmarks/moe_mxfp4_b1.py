"""Issue 27's largest part, the MoE at one token, on the checkpoint's MXFP4 experts (kernels/moe_mxfp4.py, W4A16)
against what a batch-1 step runs today (kernels/moe_small.py on the same experts converted to FP8 by
model.quant.mxfp4_to_fp8, the converter's own path), at gpt-oss-20b widths (32 experts, top 4, H = I = 2880).

Each variant is captured in a CUDA graph of REPS calls; call r routes to experts 4(r mod 8) .. 4(r mod 8) + 3 (its
logits favour them), so eight calls in a row read all 32 experts and every call's weights come from HBM (a call
reads 99.5 MB in FP8, 52.9 MB in MXFP4 with its exponents; the L2 holds 50-60). Bytes are the weights and scales
a call reads; GB/s against this run's copy rate. Every MXFP4 row is checked against the fp32 reference on the
dequantised weights (a config off it is marked WRONG); the FP8 row is the kernel tests' business.

    python -m benchmarks.moe_mxfp4_b1 [--reps 48] [--no-sweep] [--kernels]     # writes $OUT/moe_mxfp4_b1.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import report_rows
from benchmarks.fusion import copy_gbps, graph_us

DEV = "cuda"  # module constants, so a CPU smoke (tests/kernels/test_moe_mxfp4.py) can shrink them
E, TOP_K, H, I = 32, 4, 2880, 2880
ALPHA, LIMIT = 1.702, 7.0
ROUTINGS = 8  # disjoint expert sets a graph cycles through
ACT = torch.bfloat16  # activations and biases (the CPU smoke runs fp32: the interpreter truncates to bf16)


def random_mxfp4_experts(e: int, h: int, i: int, dev: str, g: torch.Generator):
    """Mxfp4Experts with random codes and exponents 2^-9 .. 2^-4 (times e2m1 values up to 6), biases in ACT."""
    from kernels.moe_mxfp4 import Mxfp4Experts

    def mx(n: int, k: int):
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), device=dev, generator=g, dtype=torch.int32)
        scales = torch.randint(118, 124, (e, n, k // 32), device=dev, generator=g, dtype=torch.int32)
        return blocks.to(torch.uint8), scales.to(torch.uint8)

    (w1b, w1s), (w2b, w2s) = mx(2 * i, h), mx(h, i)
    b1 = (torch.randn(e, 2 * i, device=dev, generator=g) * 0.1).to(ACT)
    b2 = (torch.randn(e, h, device=dev, generator=g) * 0.1).to(ACT)
    return Mxfp4Experts.from_blocks(w1b, w1s, b1, w2b, w2s, b2, alpha=ALPHA, limit=LIMIT)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(*w.shape[:2], -1, 16)


def reference_out(x: torch.Tensor, logits: torch.Tensor, top_k: int, w) -> torch.Tensor:
    """fp32 MoE on the dequantised weights (kernels.reference.moe), routing in the logits' dtype."""
    from kernels import reference as ref
    from model.quant import dequantize_mxfp4

    vals, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(vals, dim=-1, dtype=vals.dtype).float()
    w1 = dequantize_mxfp4(_blocks(w.w1), w.w1_exp, torch.float32)
    w2 = dequantize_mxfp4(_blocks(w.w2), w.w2_exp, torch.float32)
    return ref.moe(x.float(), weights, ids, w1, w.b1.float(), w2, w.b2.float(), w.alpha, w.limit)


def fp8_experts(w):
    """The same experts as the converter would write them: e4m3 with 128x128 scales (kernels.interface)."""
    from kernels.interface import ExpertWeights
    from model.quant import mxfp4_to_fp8

    w1, s1, _ = mxfp4_to_fp8(_blocks(w.w1), w.w1_exp)
    w2, s2, _ = mxfp4_to_fp8(_blocks(w.w2), w.w2_exp)
    return ExpertWeights(w1, s1, w.b1, w2, s2, w.b2, 0, w.num_local, w.alpha, w.limit)  # one rank: all experts


def mxfp4_configs(sweep: bool) -> list:
    from kernels.moe_mxfp4 import Mxfp4Config

    cfgs = [Mxfp4Config()]
    if sweep:
        # the fp32 form's tiles were swept in any-card-next-1 (H100: 16 rows x 32 groups at 4 warps best, 52.0 us
        # against 60.4 at the default; groups, warps, stages and PDL moved it little): its best stays as a baseline
        cfgs += [Mxfp4Config(block_n1=16, block_n2=16),
                 # products summed in f16x2 after Hopper's e4m3x2 conversion (sass_probe moe_mxfp4_f16: 2.8
                 # instructions a weight at 8 rows on one warp against 5.7 for the default; on the H100 44.7 us,
                 # any-card-next-1), then decoded by integer ops alone (f16_lop: no conversion unit)
                 Mxfp4Config(dot="f16_cvt", num_warps=1),
                 Mxfp4Config(dot="f16_lop", num_warps=1), Mxfp4Config(dot="f16_lop", num_warps=2),
                 Mxfp4Config(dot="f16_lop", block_n1=16, block_n2=16, num_warps=1),
                 # the next K step's loads before this one's math (128 registers at 8 rows: two waves of programs)
                 Mxfp4Config(dot="f16_lop", num_warps=1, prefetch=True),
                 Mxfp4Config(dot="f16_lop", block_n1=4, block_n2=4, num_warps=1, prefetch=True),
                 Mxfp4Config(dot="f16_cvt", num_warps=1, prefetch=True)]
    return cfgs


def _name(c) -> str:
    return (f"mxfp4 rows {c.block_n1}/{c.block_n2} x {c.groups} groups w{c.num_warps} s{c.num_stages}"
            f"{' pdl' if c.pdl else ''}{'' if c.dot == 'fp32' else ' ' + c.dot}{' prefetch' if c.prefetch else ''}")


def _row(variant: str, us: float, nbytes: float, copy: float, base: float | None, ok: bool = True) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"what": "moe 1 token", "variant": variant + ("" if ok else " WRONG"), "us": us, "bytes": int(nbytes),
            "GBps": gbps, "ratio_copy": gbps / copy, "speedup": base / us if base else None}


def _inputs():
    """(MXFP4 experts, the same in FP8, x [1, H], ROUTINGS logits [1, E]): routing r favours experts
    per * r .. per * (r + 1) - 1, so cycling the logits reads every expert from HBM."""
    g = torch.Generator(device=DEV).manual_seed(0)
    w = random_mxfp4_experts(E, H, I, DEV, g)
    x = torch.randn(1, H, device=DEV, generator=g).to(ACT)
    per = E // ROUTINGS  # experts a routing favours (>= TOP_K at 20b widths: 4)
    logits = [torch.randn(1, E, device=DEV, generator=g).to(ACT) for _ in range(ROUTINGS)]
    for r, lg in enumerate(logits):
        lg[0, r * per:(r + 1) * per] += 20.0
    return w, fp8_experts(w), x, logits


def moe_rows(reps: int, copy: float, sweep: bool) -> list[dict]:
    from kernels.moe_mxfp4 import SmallBatchMxfp4MoE
    from kernels.moe_small import SmallBatchMoE

    w, wf, x, logits = _inputs()
    calls = iter(range(1 << 62))

    def cycling(fn):
        return lambda: fn(logits[next(calls) % ROUTINGS])

    # one expert's bytes (weights and scales) times the experts a call reads
    fp8_bytes = TOP_K * sum(q[0].numel() + 4 * s[0].numel() for q, s in ((wf.w1, wf.w1_scale), (wf.w2, wf.w2_scale)))
    mx_bytes = TOP_K * sum(q[0].numel() + s[0].numel() for q, s in ((w.w1, w.w1_exp), (w.w2, w.w2_exp)))
    small = SmallBatchMoE()
    base = graph_us(cycling(lambda lg: small(x, lg, TOP_K, wf)), reps)
    rows = [_row("fp8 moe_small (default)", base, fp8_bytes, copy, None)]
    want = reference_out(x, logits[0], TOP_K, w)
    for cfg in mxfp4_configs(sweep):
        moe = SmallBatchMxfp4MoE(cfg)
        got = moe(x, logits[0], TOP_K, w).float()
        ok = bool((got - want).norm() <= 1e-2 * want.norm())
        us = graph_us(cycling(lambda lg, moe=moe: moe(x, lg, TOP_K, w)), reps)
        rows.append(_row(_name(cfg), us, mx_bytes, copy, base, ok))
    return rows


def kernel_rows(reps: int, configs: list) -> list[dict]:
    """Each kernel's own device time (torch.profiler, eager launches without PDL, so no kernel's time includes a wait
    for the one before): FP8 moe_small and the given MXFP4 configs, weights from HBM (cycling) and the same call
    repeated (its 4 experts stay in L2). A kernel that takes as long from L2 as from HBM is not bound by the bytes."""
    from dataclasses import replace

    from torch.profiler import ProfilerActivity, profile

    from kernels.moe_mxfp4 import SmallBatchMxfp4MoE
    from kernels.moe_small import SmallBatchMoE

    w, wf, x, logits = _inputs()
    small = SmallBatchMoE(replace(SmallBatchMoE.config_for(TOP_K), pdl=False))
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)  # the CPU smoke profiles nothing
    variants = [("fp8 moe_small", lambda lg: small(x, lg, TOP_K, wf))]
    for cfg in configs:
        moe = SmallBatchMxfp4MoE(replace(cfg, pdl=False))
        variants.append((_name(replace(cfg, pdl=False)), lambda lg, moe=moe: moe(x, lg, TOP_K, w)))
    rows = []
    for name, fn in variants:
        for routing in ("hbm", "l2"):
            for _ in range(2 * ROUTINGS):
                fn(logits[0])
            sync()
            with profile(activities=[ProfilerActivity.CUDA if DEV == "cuda" else ProfilerActivity.CPU]) as prof:
                for r in range(reps):
                    fn(logits[r % ROUTINGS if routing == "hbm" else 0])
                sync()
            for k in prof.key_averages():
                if k.self_device_time_total > 0 and k.count >= reps:  # the MoE's kernels, once (or more) a call
                    rows.append({"what": "kernel", "variant": name, "routing": routing, "kernel": k.key[:48],
                                 "us": k.self_device_time_total / k.count, "per_call": k.count / reps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=48, help="calls per graph (a multiple of 8 reads every expert)")
    ap.add_argument("--no-sweep", action="store_true", help="the default config only")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel's device time (profiler, no PDL), weights from HBM and from L2, for FP8 "
                         "moe_small and the f16 forms")
    a = ap.parse_args()
    copy = copy_gbps()
    print(f"copy {copy:.0f} GB/s (bytes read + written)", flush=True)
    rows = moe_rows(a.reps, copy, not a.no_sweep)
    path = report_rows("moe_mxfp4_b1.json", vars(a), copy, rows, lambda r: f"{r['variant']:<52}")
    if a.kernels:
        from kernels.moe_mxfp4 import Mxfp4Config
        krows = kernel_rows(a.reps, [Mxfp4Config(), Mxfp4Config(dot="f16_cvt", num_warps=1),
                                     Mxfp4Config(dot="f16_lop", num_warps=1),
                                     Mxfp4Config(dot="f16_lop", num_warps=1, prefetch=True)])
        for r in krows:
            print(f"kernel {r['variant']:<56} {r['routing']:<4} {r['kernel']:<48} {r['us']:8.2f} us", flush=True)
        data = json.loads(path.read_text())
        path.write_text(json.dumps(data | {"kernels": krows}, indent=1))


if __name__ == "__main__":
    main()
