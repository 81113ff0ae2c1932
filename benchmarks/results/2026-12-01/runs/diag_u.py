"""GPU run U diagnostic (one H200): FlashInfer 0.6.6's `fp8_blockscale_gemm_sm90` (TensorRT-LLM's
DeepGEMM-derived Hopper kernel, JIT-built with nvcc + NVRTC on the machine) at the dense shapes of
M = 8192 beside torch._scaled_mm (cuBLASLt) on the same operands: does any kernel we can load beat
cuBLASLt here? It wants K % 128 == 0, so QKV's K = 2880 is zero-padded to 2944 (FLOPs counted on
the real K). No bias epilogue in either call."""
from __future__ import annotations

import time
import traceback

import torch

from benchmarks.gemm import bench
from kernels import reference as ref
from kernels.fp8_quant import quantize_act_1x128

torch.manual_seed(0)
dev = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
        t0 = time.time()
        from flashinfer.gemm.gemm_base import get_fp8_blockscale_gemm_runner_sm90
        get_fp8_blockscale_gemm_runner_sm90()
        print(f"flashinfer fp8_blockscale_gemm_sm90 module built/loaded in {time.time() - t0:.0f} s")
    except Exception:
        traceback.print_exc()
        return
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        m = 8192
        kp = -(-k // 128) * 128
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device=dev) * 0.05)
        want = ref.fp8_linear(x, w, ws, None, quantize_activations=True)
        xq, xs = quantize_act_1x128(x, k_pad=kp, m_align=4)  # xs [M, KB], strides (1, M)
        wp = torch.zeros(n, kp, dtype=w.dtype, device=dev)
        wp[:, :k] = w
        flops = 2 * m * n * k
        y_mm = torch._scaled_mm(xq, wp.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
        ms = bench([lambda: torch._scaled_mm(xq, wp.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)])
        print(f"scaled_mm {name} M={m} N={n} K={k} (pad {kp}): err {rel(y_mm, want):.2e} {ms * 1e3:.1f} us "
              f"{flops / ms / 1e9:.0f} TFLOP/s")
        try:
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            t0 = time.time()
            fp8_blockscale_gemm_sm90(xq, wp, xs, ws, out=y)
            torch.cuda.synchronize()
            print(f"  first call (NVRTC JIT) {time.time() - t0:.1f} s; err {rel(y, want):.2e}")
            ms = bench([lambda: fp8_blockscale_gemm_sm90(xq, wp, xs, ws, out=y)])
            print(f"fi_blockscale {name} M={m} N={n} K={k} (pad {kp}): err {rel(y, want):.2e} {ms * 1e3:.1f} us "
                  f"{flops / ms / 1e9:.0f} TFLOP/s")
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
