"""GPU run DG17 (one H200): the few-token dense FP8 linear (kernels/dense_small.py) at decode sizes
against the bf16 GEMV (F.linear, the workers' default for QKV/O) and DeepGEMM's 64x128 tile with
its separate quantisation (the FP8 path until now), with a small sweep of its launch settings.
CUDA-graph replay over weight copies that exceed L2 (benchmarks.gemm.bench); us per call and the
weight bytes streamed per second. kernels/dense_small.py is at commit 19e389d: it was removed after this
run (0.3-0.9 TB/s, slower than both; benchmarks/results/2026-12-01/2026-12-02-runs-DG13-DG18.md), so this
script runs only on that commit."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg
from kernels.dense_small import DenseSmallConfig, dense_fp8_small

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
M_VALUES = [1, 8, 32, 64]
BASE = DenseSmallConfig()
SWEEP = [BASE] + [dataclasses.replace(BASE, block_n=bn, ctas_per_sm=c, num_stages=s)
                  for bn in (64, 128) for c in (2, 4) for s in (2, 4)]


def main() -> None:
    from benchmarks.gemm import bench, copies_for
    from kernels import reference as ref
    torch.manual_seed(0)
    print(f"{'shape':<4} {'M':>3} {'variant':<34} {'us':>6} {'TB/s':>5} err", flush=True)
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        w, ws = ref.quantize_fp8_blockwise(w32)
        b = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        copies = copies_for(w.numel())
        sets = [(w.clone(), ws.clone(), w32.to(torch.bfloat16)) for _ in range(copies)]
        augs = [dl.augment_weight(a, s, b) for a, s, _ in sets]
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)

            def row(label: str, calls, nbytes: int, y=None) -> float:
                ms = bench(calls)
                err = f"{float((y.float() - want).norm() / want.norm()):.1e}" if y is not None else ""
                print(f"{name:<4} {m:>3} {label:<34} {ms * 1e3:6.1f} {nbytes / ms / 1e9:5.2f} {err}", flush=True)
                return ms
            row("bf16 F.linear", [lambda wb=wb: F.linear(x, wb, b) for *_, wb in sets], n * k * 2)
            cfg = dataclasses.replace(dl.SMALL, shape_n=n, shape_k=augs[0].w.shape[1])
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def dg_small(g) -> None:
                a, xs = dl.augment_activations(x, g)
                dg.gemm(cfg, a, xs, g.w, g.ws, y)
            dg_small(augs[0])
            row("deepgemm 64x128 + quant", [lambda g=g: dg_small(g) for g in augs], n * k, y)
            for c in SWEEP:
                label = f"dense_small {c.block_n} cta{c.ctas_per_sm} st{c.num_stages}"
                try:
                    y = dense_fp8_small(x, w, ws, b, c)
                except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result
                    print(f"{name:<4} {m:>3} {label:<34} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row(label, [lambda a=a, s=s, c=c: dense_fp8_small(x, a, s, b, c) for a, s, _ in sets], n * k, y)


if __name__ == "__main__":
    main()
