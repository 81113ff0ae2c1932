"""The few-token dense FP8 linear (kernels/dense_small.py) vs reference.fp8_linear on CPU through
the Triton interpreter: K not a multiple of 128, N not a multiple of the tile, 1..64 rows, K split
across programs (partials summed by the last to arrive) or not, with and without bias."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.dense_small import MAX_ROWS, DenseSmallConfig, dense_fp8_small  # noqa: E402


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)).to(dtype)  # groups of unequal range
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen).to(dtype)
    return x, w, ws, b


@pytest.mark.parametrize("m,n,k,split", [
    (1, 200, 300, 0), (3, 200, 300, 2), (16, 130, 256, 1), (17, 64, 384, 3), (MAX_ROWS, 96, 200, 0),
])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_the_reference_fp32(m, n, k, split, bias):
    x, w, ws, b = _case(m, n, k, torch.float32, seed=m + k)
    got = dense_fp8_small(x, w, ws, b if bias else None, DenseSmallConfig(split_k=split))
    want = ref.fp8_linear(x, w, ws, b if bias else None, quantize_activations=True)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # the same e4m3 codes and scales; only the order of the fp32 sums differs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_bf16_rounds_like_the_reference_and_splits_agree():
    x, w, ws, b = _case(5, 256, 2880 // 8, torch.bfloat16, seed=7)
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
    outs = [dense_fp8_small(x, w, ws, b, DenseSmallConfig(split_k=s)) for s in (1, 2, 3)]
    for got in outs:
        assert got.dtype == torch.bfloat16
        assert float((got.float() - want.float()).abs().max()) <= float(want.float().abs().max()) * 2 ** -7
    assert torch.equal(outs[1], dense_fp8_small(x, w, ws, b, DenseSmallConfig(split_k=2)))  # deterministic


def test_zero_rows_and_too_many_rows():
    x, w, ws, b = _case(0, 64, 128, torch.float32)
    assert dense_fp8_small(x, w, ws, b).shape == (0, 64)
    x, w, ws, b = _case(MAX_ROWS + 1, 64, 128, torch.float32)
    with pytest.raises(AssertionError):
        dense_fp8_small(x, w, ws, b)
