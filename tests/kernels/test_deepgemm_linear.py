"""The dense DeepGEMM linear's bias-in-K augmentation (kernels/deepgemm_linear.py) on CPU: the
augmented operands, multiplied out by the reference dequantisation, must give x W^T + b exactly as
`reference.fp8_linear` does. The kernel itself runs in tests/kernels/test_gemm_moe_gpu.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the quantiser is a Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.deepgemm_linear import (BIAS_TERMS, ROW_ALIGN, augment_activations, augment_weight,  # noqa: E402
                                     split_bias_fp8)


@pytest.mark.parametrize("n", [300, 128, 5])
def test_split_bias_terms_sum_to_the_bias(n: int):
    gen = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)  # magnitudes over 4 decades
    q, s = split_bias_fp8(b)
    assert q.shape == (n, BIAS_TERMS) and q.dtype == torch.float8_e4m3fn and s.shape == (-(-n // 128),)
    got = (q.float() * s.repeat_interleave(128)[:n, None]).sum(-1)
    bound = s.repeat_interleave(128)[:n] * 2.0 ** -9  # e4m3 subnormal step of the block's scale
    err = (got - b).abs()
    assert bool((err <= torch.maximum(bound, b.abs() * 2.0 ** -11)).all()), float(err.max())
    # one term alone is coarse: the split is what buys the precision
    one = q[:, 0].float() * s.repeat_interleave(128)[:n]
    assert float((one - b).abs().max()) > 10 * float(err.max())


@pytest.mark.parametrize("m,n,k,bias", [(5, 256, 2880, True), (3, 200, 256, True), (4, 130, 300, False)])
def test_augmented_operands_give_the_biased_linear(m: int, n: int, k: int, bias: bool):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen) if bias else None
    w_aug, ws_aug = augment_weight(w, ws, b)
    kb0 = -(-k // 128)
    assert w_aug.stride(0) % ROW_ALIGN == 0 and torch.equal(w_aug[:, :k].float(), w.float())
    a, xs = augment_activations(x, w_aug, bias)  # what DeepGemmLinear hands the kernel
    assert a.stride(0) == w_aug.stride(0)
    assert xs.shape == (m, -(-w_aug.shape[1] // 128)) and xs.stride(1) % 4 == 0
    if bias:  # the constant column: 448 on the scale 1/448
        assert bool((a[:, kb0 * 128: kb0 * 128 + BIAS_TERMS].float() == 448).all())
        assert torch.allclose(xs[:, kb0], torch.full((m,), 1 / 448))
        assert bool((a[:, k: kb0 * 128].float() == 0).all())
    got = ref.dequantize_fp8_per_token(a, xs) @ ref.dequantize_fp8_blockwise(w_aug.contiguous(), ws_aug).t()
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))
