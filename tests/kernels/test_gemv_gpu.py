"""kernels/gemv.py on the GPU at gpt-oss-20b's attention projections (QKV [5120, 2880], O [2880, 4096],
bf16, with bias), M = 1, 4, 16: the first step of suite `gemv-ab`, so a wrong kernel fails before it is
timed.

  * parity with an fp32 reference (one rounding: half a bf16 ulp + fp32 order) and with torch's addmm
    (what runs today: within a bf16 ulp, another summation order), default config and a sweep's configs;
  * the same bits on every call, and under CUDA-graph capture and replay (the decode worker's graphs);
  * the model routing: a 20b-width layer's one-token projections with Fusion.FEW_TOKEN_LINEAR on take the kernel.

Run alone (CPU kernel tests set TRITON_INTERPRET=1 at import):
    python -m pytest -q -m gpu tests/kernels/test_gemv_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_alone import GPU_ALONE

pytestmark = GPU_ALONE

DEV = "cuda"
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}  # W [N, K]


def _case(what: str, m: int, seed: int):
    n, k = SHAPES[what]
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    ref = x.double() @ w.double().T + b.double()  # [M, N]
    return x, w, b, ref.float()


def _configs():
    from kernels.gemv import DEFAULT_CONFIG, GemvConfig

    return [DEFAULT_CONFIG, GemvConfig(split=1), GemvConfig(block_n=128, num_warps=8),
            GemvConfig(block_k=256, num_stages=3), GemvConfig(block_n=32, waves=8),
            GemvConfig(rows_t1=0), GemvConfig(rows_t1=16, block_k_t1=256), GemvConfig(rows_t1=4, block_k_t1=1024)]


@pytest.mark.parametrize("what", ["qkv", "o"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_parity_and_determinism(what, m):
    from kernels.gemv import few_token_linear

    x, w, b, ref = _case(what, m, seed=m)
    addmm = torch.nn.functional.linear(x, w, b)
    for cfg in _configs():
        y = few_token_linear(x, w, b, cfg)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-4, msg=lambda s: f"{cfg}: {s}")
        torch.testing.assert_close(y.float(), addmm.float(), rtol=2 ** -7, atol=1e-3)  # a bf16 ulp apart at most
        for _ in range(3):
            assert torch.equal(few_token_linear(x, w, b, cfg), y), cfg
    y0 = few_token_linear(x, w, None)
    torch.testing.assert_close(y0.float(), ref - b.float(), rtol=2 ** -8, atol=1e-4)


@pytest.mark.parametrize("m", [1, 16])
def test_cuda_graph_replay(m):
    """Captured with the caching allocator's partials, replayed on new inputs: the eager bits."""
    from kernels.gemv import few_token_linear

    cases = {what: _case(what, m, seed=10 + m) for what in SHAPES}
    xs = {what: c[0].clone() for what, c in cases.items()}
    for what, (x, w, b, _) in cases.items():  # warm-up: compile outside the capture
        few_token_linear(xs[what], w, b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {what: few_token_linear(xs[what], w, b) for what, (_, w, b, _) in cases.items()}
    for seed in (1, 2):
        for what, (x, w, b, _) in cases.items():
            xs[what].copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16) * seed)
        graph.replay()
        torch.cuda.synchronize()
        for what, (_, w, b, _) in cases.items():
            assert torch.equal(outs[what], few_token_linear(xs[what], w, b)), (what, seed)


def test_attention_projections_routed():
    """Backends.attn_linear at 20b widths: the switch on sends one token to the kernel (its bits), 2 and 17 to
    the linear backend (addmm's bits); off, everything is addmm."""
    from kernels.gemv import few_token_linear
    from kernels.registry import make_backends, parse_fusions

    be = make_backends("torch", "torch", "torch", "rope_store+gemv")
    for m in (1, 2, 17):
        x, w, b, _ = _case("qkv", m, seed=m)
        got = be.attn_linear(x, w, None, b)
        want = few_token_linear(x, w, b) if m == 1 else torch.nn.functional.linear(x, w, b)
        assert torch.equal(got, want), m
    be.fusions = parse_fusions("rope_store")
    x, w, b, _ = _case("o", 1, seed=0)
    assert torch.equal(be.attn_linear(x, w, None, b), torch.nn.functional.linear(x, w, b))
