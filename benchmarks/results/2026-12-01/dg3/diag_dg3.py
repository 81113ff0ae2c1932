"""GPU run DG3 (one H200): (1) the dense DeepGEMM linear with bias at row strides of 16 vs 128
bytes (O with bias ran 27 us slower than without in DG2, 4x what its extra K block should cost);
(2) where the DeepGEMM MoE's time goes at 8192 tokens (20b): per-kernel CUDA time from the profiler."""
from __future__ import annotations

import traceback

import torch


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def strides(bench) -> None:
    from kernels import reference as ref
    from kernels.deepgemm_linear import DeepGemmLinear
    m = 8192
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.05)
        b = torch.randn(n, device="cuda").to(torch.bfloat16)
        want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)
        for align in (16, 128):
            lin = DeepGemmLinear(row_align=align)
            for bias in (b, None):
                call = lambda lin=lin, bias=bias: lin(x, w, ws, bias)  # noqa: E731
                err = rel(call(), want if bias is not None else want - b.float())
                ms = bench([call])
                print(f"linear {name} row_align {align} bias={bias is not None}: err {err:.2e} {ms * 1e3:.1f} us "
                      f"{2 * m * n * k / ms / 1e9:.0f} TFLOP/s (incl. quantisation)", flush=True)


def profile_moe() -> None:
    from kernels.moe_dg import DeepGemmMoE
    from tests.kernels.test_gemm_moe_gpu import _experts
    w = _experts(32, 2880, 2880, fp8=True)
    t = 8192
    x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 32, device="cuda").to(torch.bfloat16)
    moe = DeepGemmMoE(min_rows_per_expert=0)
    for _ in range(3):
        moe(x, logits, 4, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            moe(x, logits, 4, w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)


def main() -> None:
    import sys

    from benchmarks.gemm import bench
    torch.manual_seed(0)
    parts = {"strides": lambda: strides(bench), "profile": profile_moe}
    for name in (sys.argv[1:] or parts):
        part = parts[name]
        try:
            part()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    main()
