"""GPU run V diagnostic (one H200): why torch._scaled_mm (cuBLASLt, 1x128 x 128x128 block scales)
gave a wrong QKV result at K = 2944 in run U (error 0.22, 1124 TFLOP/s) while O (K = 4096) was
right. Hypothesis: the weight-scale operand ws.t() [KB, NB] has leading dimension KB = 23, not a
multiple of 4 floats (16 bytes); at K = 4096, KB = 32. Each variant: K padding, scale leading
dimension, bias epilogue or not; error vs the reference and TFLOP/s counted on the real K."""
from __future__ import annotations

import traceback

import torch

from benchmarks.gemm import bench
from kernels import reference as ref
from kernels.fp8_quant import quantize_act_1x128

torch.manual_seed(0)
dev = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def padded_scales(ws: torch.Tensor, kb: int, ld: int) -> torch.Tensor:
    """[NB, kb] weight scales (padding blocks 1) stored with row stride ld >= kb."""
    buf = torch.ones(ws.shape[0], ld, dtype=ws.dtype, device=ws.device)
    buf[:, : ws.shape[1]] = ws
    return buf[:, :kb]


def main() -> None:
    m = 8192
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device=dev) * 0.05)
        b = torch.randn(n, device=dev).to(torch.bfloat16)
        want = ref.fp8_linear(x, w, ws, None, quantize_activations=True)
        want_b = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
        flops = 2 * m * n * k
        for kp in dict.fromkeys((k, -(-k // 128) * 128, -(-k // 512) * 512)):
            kb = -(-kp // 128)
            xq, xs = quantize_act_1x128(x, k_pad=kp)
            wp = torch.zeros(n, kp, dtype=w.dtype, device=dev)
            wp[:, :k] = w
            for ld in dict.fromkeys((kb, -(-kb // 4) * 4, -(-kb // 16) * 16)):
                wsp = padded_scales(ws, kb, ld)
                for bias in (None, b):
                    tag = f"{name} K={k} pad {kp} ld {ld} {'bias' if bias is not None else 'nobias'}"
                    try:
                        def call():
                            return torch._scaled_mm(xq, wp.t(), scale_a=xs, scale_b=wsp.t(), bias=bias,
                                                    out_dtype=torch.bfloat16)
                        y = call()
                        err = rel(y, want if bias is None else want_b)
                        ms = bench([call])
                        print(f"scaled_mm {tag}: err {err:.2e} {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s")
                    except Exception as e:  # noqa: BLE001
                        print(f"scaled_mm {tag}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
