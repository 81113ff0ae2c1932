"""The few-token FP8 dense linear (kernels/dense_small.py) against the reference FP8 linear
(`reference.fp8_linear`, activations quantised 1x128), on CPU through the Triton interpreter: both tile
orientations, TMA, fixed and chosen K splits, K with a half last block (2880), bias or none, repeat bits."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from kernels import reference as ref
from kernels.dense_small import DenseSmallConfig, FewTokenFp8Linear
from kernels.fp8_quant import quantize_act_1x128

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _case(t: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(t, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, ws, b


VARIANTS = {"mma16": dict(swap_ab=False, tma=False, block_n=64), "swap_ab": dict(swap_ab=True, tma=False),
            "swap_ab_tma": dict(swap_ab=True, tma=True), "swap_ab_tma_64": dict(swap_ab=True, tma=True, block_n=64)}
CASES = [(1, 192, 2880, split, variant, True) for split in (0, 1, 3) for variant in VARIANTS] + [
    (3, 130, 384, 2, "swap_ab_tma", False), (16, 64, 256, 0, "swap_ab", True), (2, 320, 512, 4, "mma16", False)]


@pytest.mark.parametrize("t,n,k,split,variant,bias", CASES)
def test_fp32_tight_vs_reference(t, n, k, split, variant, bias):
    x, w, ws, b = _case(t, n, k, torch.float32, seed=t + n, bias=bias)
    lin = FewTokenFp8Linear(DenseSmallConfig(split_k=split, **VARIANTS[variant]))
    y = lin(x, w, ws, b)
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert _rel(y, ref.fp8_linear(x, w, ws, b, quantize_activations=True)) < 1e-5
    assert all(int(c.abs().sum()) == 0 for c in lin._counters._bufs.values()), "counters reset by their last CTA"
    assert torch.equal(y, lin(x, w, ws, b)), "partials summed in split order: the same bits every call"


def test_quantises_x_as_the_act_quantiser():
    """The in-launch quantisation is quantize_act_1x128's: with W = identity blocks the output is x's
    quantised-dequantised values (to fp32 rounding: W's block scale is 1/448, its codes 448)."""
    t, k = 2, 256
    x = torch.randn(t, k) * 3
    w, ws = ref.quantize_fp8_blockwise(torch.eye(k))
    y = FewTokenFp8Linear(DenseSmallConfig(split_k=2))(x, w, ws, None)
    xq, xs = quantize_act_1x128(x)
    assert torch.allclose(y, ref.dequantize_fp8_per_token(xq, xs), rtol=1e-6, atol=0)


def test_bf16_and_no_tokens():
    x, w, ws, b = _case(1, 192, 2880, torch.bfloat16, seed=7, bias=True)
    lin = FewTokenFp8Linear()
    y = lin(x, w, ws, b)
    assert y.dtype == torch.bfloat16
    # the interpreter truncates fp32 -> bf16 where the GPU rounds: one bf16 ulp one-sided
    assert _rel(y, ref.fp8_linear(x, w, ws, b, quantize_activations=True)) < 1e-2
    assert lin(x[:0], w, ws, b).shape == (0, 192)
