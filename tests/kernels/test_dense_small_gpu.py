"""kernels/dense_small.py on the GPU at gpt-oss-20b's attention projections (QKV [5120, 2880], O [2880, 4096], FP8
128x128 weights, bf16 activations, with bias), T = 1, 4, 16: the first step of suite `fp8-gemv-ab`, so a wrong
kernel fails before it is timed.

  * parity with the reference FP8 linear (activations quantised 1x128; fp32 sums in another order, one bf16
    rounding), default config and a sweep's;
  * the same bits on every call, and under CUDA-graph capture and replay (the decode worker's graphs);
  * the routing: Fusion.FEW_TOKEN_FP8 takes FP8 projections of 1 token, not bf16 ones nor 2 tokens.

Run alone (CPU kernel tests set TRITON_INTERPRET=1 at import):
    python -m pytest -q -m gpu tests/kernels/test_dense_small_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_alone import GPU_ALONE
from tests.support.cuda_graph import capture

pytestmark = GPU_ALONE

DEV = "cuda"
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}  # W [N, K]


def _case(what: str, t: int, seed: int):
    from kernels import reference as ref

    n, k = SHAPES[what]
    g = torch.Generator(device=DEV).manual_seed(seed)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device=DEV, generator=g) * k ** -0.5)
    x = torch.randn(t, k, device=DEV, generator=g).to(torch.bfloat16)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    return x, w, ws, b


def configs():
    from kernels.dense_small import DenseSmallConfig

    return [DenseSmallConfig(), DenseSmallConfig(block_n=128), DenseSmallConfig(tma=False),
            DenseSmallConfig(split_k=1), DenseSmallConfig(pdl=True), DenseSmallConfig(ctas_per_sm=2, num_stages=4)]


@pytest.mark.parametrize("what", ["qkv", "o"])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_parity_and_determinism(what, t):
    from kernels import reference as ref
    from kernels.dense_small import FewTokenFp8Linear

    x, w, ws, b = _case(what, t, seed=t)
    want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)  # fp32, the kernel's math
    for cfg in configs():
        lin = FewTokenFp8Linear(cfg)
        y = lin(x, w, ws, b)
        assert y.dtype == torch.bfloat16 and y.shape == want.shape
        torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=1e-3, msg=lambda s: f"{cfg}: {s}")
        for _ in range(3):
            assert torch.equal(lin(x, w, ws, b), y), cfg
    y0 = FewTokenFp8Linear()(x, w, ws, None)
    torch.testing.assert_close(y0.float(), want - b.float(), rtol=2 ** -7, atol=1e-3)


def test_cuda_graph_replay_same_bits():
    from kernels.dense_small import FewTokenFp8Linear

    x, w, ws, b = _case("qkv", 1, seed=3)
    lin = FewTokenFp8Linear()
    eager = lin(x, w, ws, b)
    g, out = capture(lambda: lin(x, w, ws, b))
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lin(x, w, ws, b))


def test_routing():
    from kernels.registry import Backends, parse_fusions

    calls = []

    def linear(x, w, s, b):
        calls.append(("linear", x.shape[0]))
        return torch.zeros(x.shape[0], w.shape[0], device=DEV, dtype=x.dtype)

    be = Backends(None, linear, None, fusions=parse_fusions("rope_store+fp8_gemv"))
    x, w, ws, b = _case("o", 2, seed=1)
    be.attn_linear(x[:1], w, ws, b)
    be.attn_linear(x, w, ws, b)  # 2 tokens: the linear backend (registry.FEW_TOKEN_FP8_MAX_TOKENS)
    be.attn_linear(x[:1], torch.randn(w.shape, device=DEV).to(torch.bfloat16), None, b)  # bf16 weight
    assert calls == [("linear", 2), ("linear", 1)]
