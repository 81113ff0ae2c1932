"""GPU diagnostic (one H200): DeepGEMM's SM90 FP8 kernel through our launcher
(kernels/deepgemm_sm90.py), dense and M-grouped, at the gpt-oss-20b prefill shapes (M = 8192
tokens), against the reference and next to cuBLASLt's block-scaled GEMM. Prints one line per
configuration: error vs reference, us, TFLOP/s on the real (unpadded) K.

`--build-only` compiles every configuration into the cache (run on the CPU machine, then carry it).
"""
from __future__ import annotations

import argparse
import traceback

import torch

from kernels import deepgemm_sm90 as dg

DENSE = [dg.DgConfig(128, n, mcast=mc, mcast_on_a=on_a)
         for n in (128, 144, 160, 192) for mc, on_a in ((1, False), (2, False), (2, True))]
DENSE += [dg.DgConfig(256, 128), dg.DgConfig(256, 128, mcast=2, mcast_on_a=True)]
GROUPED = [dg.DgConfig(128, n, mcast=mc, gemm_type=dg.GROUPED, groups=32)
           for n in (128, 144, 160, 192) for mc in (1, 2)]
GROUPED += [dg.DgConfig(128, n, mcast=2, mcast_on_a=True, gemm_type=dg.GROUPED, groups=32)
            for n in (128, 160)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def dense(bench) -> None:
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    m = 8192
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.05)
        want = ref.fp8_linear(x, w, ws, None, quantize_activations=True)
        xq, xs = quantize_act_1x128(x, m_align=4)
        sfa = xs.t()  # the [KB, M_al] buffer behind the transposed view
        assert sfa.is_contiguous()
        flops = 2 * m * n * k
        kp = -(-k // 512) * 512
        xq_p, xs_p = quantize_act_1x128(x, k_pad=kp)
        wp = torch.zeros(n, kp, dtype=w.dtype, device="cuda")
        wp[:, :k] = w
        wsp = torch.ones(ws.shape[0], kp // 128, device="cuda")
        wsp[:, : ws.shape[1]] = ws

        def cublas():
            return torch._scaled_mm(xq_p, wp.t(), scale_a=xs_p, scale_b=wsp.t(), out_dtype=torch.bfloat16)
        ms = bench([cublas])
        print(f"{name} scaled_mm(K->{kp}) err {rel(cublas(), want):.2e} {ms * 1e3:.1f} us "
              f"{flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for cfg in DENSE:
            tag = f"{name} dg {cfg.block_m}x{cfg.block_n} st{cfg.resolved_stages()} mc{cfg.mcast}{'A' if cfg.mcast_on_a else 'B'}"
            try:
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                def call(cfg=cfg, out=out):
                    return dg.gemm(cfg, xq, sfa, w, ws.contiguous(), out)
                err = rel(call(), want)
                ms = bench([call])
                print(f"{tag}: err {err:.2e} {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{tag}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def grouped(bench) -> None:
    """20b prefill MoE at 8192 tokens: 32 experts, top-4 -> 32768 rows, random routing."""
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    e, t, top_k, hidden = 32, 8192, 4, 2880
    ids = torch.rand(t, e, device="cuda").topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(ids, minlength=e)
    padded = ((counts + 127) // 128) * 128
    rows = int(padded.sum())
    layout = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    starts = torch.cumsum(padded, 0) - padded
    for g in range(e):
        layout[int(starts[g]): int(starts[g]) + int(counts[g])] = g
    for name, n, k in (("gate_up", 2 * hidden, hidden), ("down", hidden, hidden)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(e * n, k, device="cuda") * 0.05)
        ws = ws.view(e, -1, ws.shape[1]).contiguous()  # [E, NB, KB]: n % 128 == 0 here
        xq, xs = quantize_act_1x128(x, m_align=4)
        sfa = xs.t()
        want = torch.zeros(rows, n, device="cuda")
        wd = ref.dequantize_fp8_blockwise(w, ws.view(-1, ws.shape[2])).view(e, n, k)
        xd = ref.dequantize_fp8_per_token(xq, xs)
        for g in range(e):
            r0, r1 = int(starts[g]), int(starts[g]) + int(counts[g])
            want[r0:r1] = xd[r0:r1].float() @ wd[g].float().t()
        valid = layout >= 0
        flops = 2 * int(counts.sum()) * n * k
        for cfg in GROUPED:
            tag = (f"{name} grouped dg {cfg.block_m}x{cfg.block_n} st{cfg.resolved_stages()} "
                   f"mc{cfg.mcast}{'A' if cfg.mcast_on_a else 'B'}")
            try:
                out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

                def call(cfg=cfg, out=out):
                    return dg.gemm(cfg, xq, sfa, w, ws, out, layout)
                err = rel(call()[valid], want[valid])
                ms = bench([call])
                print(f"{tag}: err {err:.2e} {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as ex:  # noqa: BLE001
                print(f"{tag}: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--num-sms", type=int, default=132)
    args = p.parse_args()
    if args.build_only:
        for cfg in DENSE + GROUPED:
            print(cfg, dg.library_path(cfg, args.num_sms), flush=True)
        return
    from benchmarks.gemm import bench
    torch.manual_seed(0)
    for part in (dense, grouped):
        try:
            part(bench)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    main()
