"""Prefill MoE on DeepGEMM's grouped GEMM (kernels/moe_dg.py): its Triton passes (gather, SwiGLU +
re-quantisation, combine) under TRITON_INTERPRET with the grouped GEMM as a dequantised torch
matmul, vs the FP8 reference. The DeepGEMM kernel itself runs in tests/kernels/test_gemm_moe_gpu.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.moe_dg import DeepGemmMoE  # noqa: E402
from tests.kernels.test_moe import _experts, _fp8_act_reference, _logits, _rel  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _seed():
    # Fixed inputs: with random ones an fp32 summation-order difference now and then lands on an
    # e4m3/bf16 rounding boundary (~6e-5 instead of ~1e-7 in fp32).
    torch.manual_seed(1234)


@pytest.mark.parametrize("t,k,e,el,start,h,i,b2", [
    (9, 4, 8, 8, 0, 256, 128, True),      # every expert local
    (12, 4, 8, 4, 4, 200, 72, True),      # EP rank 1 of 2; H, I not multiples of 128
    (5, 2, 4, 4, 0, 128, 128, False),     # TP shard without b2
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepgemm_moe_matches_fp8_reference(t, k, e, el, start, h, i, b2, dtype):
    x = torch.randn(t, h).to(dtype)
    logits = _logits(t, e, dtype)
    w = _experts(e, el, h, i, dtype, fp8=True, start=start, b2=b2)
    got = DeepGemmMoE(min_rows_per_expert=0)(x, logits, k, w)
    assert got.shape == x.shape and got.dtype == x.dtype
    # Its own rounding points: exact up to fp32 summation order in fp32; in bf16 the interpreter's
    # bf16 routing weights (truncated, one ulp) dominate, as in the other MoE tests.
    tight = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel(got, _fp8_act_reference(x, logits, k, w, gemm_out_bf16=True)) < tight
    # vs the fused path's reference: h in bf16 before + b1 moves a few e4m3 steps of the SwiGLU
    # re-quantisation, within the FP8 tolerance of the other MoE tests.
    assert _rel(got, _fp8_act_reference(x, logits, k, w)) < 3e-2


def test_deepgemm_moe_all_tokens_one_expert():
    t, e, k = 10, 8, 1
    x = torch.randn(t, 128).to(torch.bfloat16)
    logits = torch.full((t, e), -1.0)
    logits[:, 3] = 1.0
    w = _experts(e, e, 128, 128, torch.bfloat16, fp8=True)
    got = DeepGemmMoE(min_rows_per_expert=0)(x, logits.to(torch.bfloat16), k, w)
    assert _rel(got, _fp8_act_reference(x, logits.to(torch.bfloat16), k, w, gemm_out_bf16=True)) < 2e-2


def test_deepgemm_moe_no_local_pairs_gives_zeros():
    t, e, k = 6, 8, 2
    x = torch.randn(t, 128).to(torch.bfloat16)
    logits = torch.full((t, e), -1.0)
    logits[:, :2] = 1.0 + torch.arange(2.0)  # every pair to experts 0, 1; this rank owns 4..7
    w = _experts(e, 4, 128, 128, torch.bfloat16, fp8=True, start=4)
    assert torch.equal(DeepGemmMoE(min_rows_per_expert=0)(x, logits.to(torch.bfloat16), k, w), torch.zeros_like(x))


def test_small_batches_take_the_triton_moe():
    x = torch.randn(3, 128).to(torch.bfloat16)
    logits = _logits(3, 8, torch.bfloat16)
    w = _experts(8, 8, 128, 128, torch.bfloat16, fp8=True)
    moe = DeepGemmMoE()  # default threshold: 1.5 rows per expert are far below it
    assert torch.equal(moe(x, logits, 4, w), moe.fallback(x, logits, 4, w))
    assert torch.equal(moe(x[:0], logits[:0], 4, w), x[:0])
