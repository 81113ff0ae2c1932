"""GPU run DG5 (one H200): tile shapes for the QKV projection with bias on DeepGEMM (N = 5120,
K = 2880 + the bias block = 24 K blocks), from FP8 inputs, over weight copies that exceed L2 (as
benchmarks/gemm.py times it). `--build-only` compiles the launchers (CPU machine)."""
from __future__ import annotations

import sys

import torch

from kernels import deepgemm_sm90 as dg

CONFIGS = [dg.DgConfig(256, 128, mcast=2, mcast_on_a=True), dg.DgConfig(256, 128, mcast=2),
           dg.DgConfig(256, 112, mcast=2, mcast_on_a=True), dg.DgConfig(256, 144, mcast=2, mcast_on_a=True),
           dg.DgConfig(128, 160, mcast=2), dg.DgConfig(128, 192, mcast=2), dg.DgConfig(128, 128, mcast=2)]


def main() -> None:
    if "--build-only" in sys.argv:
        for cfg in CONFIGS:
            print(cfg, dg.library_path(cfg, 132), flush=True)
        return
    from benchmarks.gemm import bench, copies_for
    from kernels import deepgemm_linear as dl
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    torch.manual_seed(0)
    m, n, k = 8192, 5120, 2880
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.05)
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)
    augs = [dl.augment_weight(w.clone(), ws.clone(), b) for _ in range(copies_for(w.numel()))]
    w_aug = augs[0][0]
    xq, xs = quantize_act_1x128(x, k_pad=w_aug.stride(0), m_align=4, ones=(23 * 128, dl.BIAS_TERMS))
    a = xq[:, : w_aug.shape[1]]
    for cfg in CONFIGS:
        tag = f"qkv+bias dg {cfg.block_m}x{cfg.block_n} mc{cfg.mcast}{'A' if cfg.mcast_on_a else 'B'}"
        try:
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            calls = [lambda wa=wa, wsa=wsa, cfg=cfg: dg.gemm(cfg, a, xs, wa, wsa, y) for wa, wsa in augs]
            calls[0]()
            err = float((y.float() - want.float()).norm() / want.float().norm())
            ms = bench(calls)
            print(f"{tag}: err {err:.2e} {ms * 1e3:.1f} us {2 * m * n * k / ms / 1e9:.0f} TFLOP/s", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{tag}: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
