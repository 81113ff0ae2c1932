"""GPU run DG15 (one H200): the dense FP8 linear at decode sizes (M = 1..128). The 64x128 tile gives
N / 128 CTAs (QKV 40, O 23) for 132 SMs, so at M = 1 it streams the FP8 weights at ~1.2 TB/s and
loses to the bf16 GEMV, which reads twice the bytes. Sweeps narrower tiles (more CTAs, one wave)
against F.linear on bf16 weights, the whole linear from bf16 activations (quantisation included)
and the GEMM alone. CUDA-graph replay over weight copies that exceed L2 (benchmarks.gemm.bench).
`--build-only` compiles the launchers (CPU machine)."""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
BLOCK_NS = {"qkv": [32, 40, 64, 80, 128], "o": [16, 24, 48, 64, 128]}
M_VALUES = [1, 8, 32, 64, 128]


def configs(name: str) -> list[dg.DgConfig]:
    n, k = SHAPES[name]
    k_aug = dl.placement(k, True)[1]
    return [dg.DgConfig(64, bn, shape_n=n, shape_k=k_aug) for bn in BLOCK_NS[name]]


def main() -> None:
    if "--build-only" in sys.argv:
        for name in SHAPES:
            for cfg in configs(name):
                print(cfg, dg.library_path(cfg, 132).name, flush=True)
        return
    from benchmarks.gemm import bench, copies_for
    from kernels import reference as ref
    torch.manual_seed(0)
    print(f"{'shape':<4} {'M':>4} {'variant':<26} {'us':>7} {'TB/s':>6} err", flush=True)
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, device="cuda") * 0.02
        wb = w32.to(torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(w32)
        b = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        copies = copies_for(w.numel())
        augs = [dl.augment_weight(w.clone(), ws.clone(), b) for _ in range(copies)]
        wbs = [wb.clone() for _ in range(copies)]
        for m in M_VALUES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ms = bench([lambda v=v: F.linear(x, v, b) for v in wbs])
            print(f"{name:<4} {m:>4} {'bf16 F.linear':<26} {ms * 1e3:7.1f} {n * k * 2 / ms / 1e9:6.2f}", flush=True)
            a, xs = dl.augment_activations(x, augs[0])
            ms = bench([lambda: dl.augment_activations(x, augs[0])])
            print(f"{name:<4} {m:>4} {'act quant alone':<26} {ms * 1e3:7.1f}", flush=True)
            for cfg in [dl.config_for(m, n, augs[0].w.shape[1]), *configs(name)]:
                label = f"{cfg.block_m}x{cfg.block_n} mc{cfg.mcast}"
                try:
                    dg.gemm(cfg, a, xs, augs[0].w, augs[0].ws, y)
                except RuntimeError as e:
                    print(f"{name:<4} {m:>4} {label:<26} FAILED {e}", flush=True)
                    continue
                err = float((y.float() - want).norm() / want.norm())

                def full(g, cfg=cfg) -> None:
                    aa, ss = dl.augment_activations(x, g)
                    dg.gemm(cfg, aa, ss, g.w, g.ws, y)
                ms_full = bench([lambda g=g: full(g) for g in augs])
                ms_gemm = bench([lambda g=g, cfg=cfg: dg.gemm(cfg, a, xs, g.w, g.ws, y) for g in augs])
                tbs = augs[0].w.numel() / ms_gemm / 1e9
                print(f"{name:<4} {m:>4} {label + ' linear':<26} {ms_full * 1e3:7.1f} {'':>6} {err:.1e}", flush=True)
                print(f"{name:<4} {m:>4} {label + ' gemm only':<26} {ms_gemm * 1e3:7.1f} {tbs:6.2f}", flush=True)


if __name__ == "__main__":
    main()
