"""kernels.fp8_gemm.native_linear on the GPU: eager calls with a bias take mm + add (no cuBLASLt
heuristic query per call), CUDA-graph capture keeps F.linear's fused epilogue; both agree with the
fp32 product to bf16 rounding, and the captured graph replays F.linear's bits.

    python -m pytest -q -m gpu tests/kernels/test_native_linear_gpu.py
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_gemm import native_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def _operands(m: int, n: int = 5120, k: int = 2880) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    return x, w, b


@pytest.mark.parametrize("m", [1, 16, 352, 4096])
def test_native_linear_matches_fp32_to_bf16_rounding(m: int):
    x, w, b = _operands(m)
    want = F.linear(x.float(), w.float(), b.float())
    got = native_linear(x, w, b)
    fused = F.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # Two bf16 roundings (product, then sum) against the epilogue's one: within a few bf16 ulps.
    err = (got.float() - want).abs().max() / want.abs().max()
    err_fused = (fused.float() - want).abs().max() / want.abs().max()
    assert err < 3 * 2 ** -8 and err_fused < 3 * 2 ** -8, (err, err_fused)


def test_native_linear_keeps_fused_epilogue_under_graph_capture():
    x, w, b = _operands(64)
    out = torch.empty(64, w.shape[0], device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(native_linear(x, w, b))  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(native_linear(x, w, b))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, F.linear(x, w, b))


def test_native_linear_eager_host_time_below_addmm():
    """The point of the function: less host time per eager call at a prefill chunk's shape."""
    x, w, b = _operands(352)

    def host_us(fn) -> float:
        for _ in range(10):
            fn(x, w, b)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            fn(x, w, b)
        t = (time.perf_counter() - t0) / 100 * 1e6
        torch.cuda.synchronize()
        return t

    fused, plain = min(host_us(F.linear) for _ in range(3)), min(host_us(native_linear) for _ in range(3))
    print(f"host us per call: addmm {fused:.1f}, mm + add {plain:.1f}")
    assert plain < fused, (plain, fused)
