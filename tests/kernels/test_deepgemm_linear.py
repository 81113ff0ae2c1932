"""The dense DeepGEMM linear's bias-in-K augmentation (kernels/deepgemm_linear.py) on CPU: the
augmented operands, multiplied out by the reference dequantisation, must give x W^T + b exactly as
`reference.fp8_linear` does. The kernel itself runs in tests/kernels/test_gemm_moe_gpu.py."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # the quantiser is a Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.deepgemm_linear import (BIAS_TERMS, BLOCK_ROW_ALIGN, ROW_ALIGN, SMALL, augment_activations,  # noqa: E402
                                     augment_weight, config_for, launcher_configs, placement, split_bias_fp8,
                                     split_bias_on_scale)
from kernels.fp8_quant import quantize_act_1x128  # noqa: E402


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


def test_split_bias_on_a_shared_scale_up_to_the_column_budget():
    gen = torch.Generator().manual_seed(1)
    n, cols = 256, 64
    scale = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    ratio = torch.logspace(-3, 0, n) * 448 * (cols - 3)  # |b| / scale from 0.45 to the budget
    b = ratio * scale * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    q = split_bias_on_scale(b, scale, cols)
    assert q.shape == (n, cols) and q.dtype == torch.float8_e4m3fn
    err = ((q.float() * scale[:, None]).sum(-1) - b).abs()
    # the greedy split's floor is the subnormal step of the scale; fp32 itself rounds |b| at 2^-24
    assert bool((err <= torch.maximum(scale * 2.0 ** -9, b.abs() * 2.0 ** -20)).all()), float((err / scale).max())


def _dequant(a: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    return ref.dequantize_fp8_per_token(a.contiguous(), xs)


@pytest.mark.parametrize("m,n,k,bias,pad,placement", [
    (5, 256, 2880, True, True, "pad"),  # QKV: 64 free columns take the bias, 23 K blocks
    (5, 256, 2880, True, False, "block"),
    (3, 200, 256, True, True, "block"),  # no padding: an extra K block
    (3, 130, 250, True, True, "block"),  # 6 free columns: too few
    (4, 130, 300, True, True, "pad"),
    (4, 130, 300, False, True, None),
])
def test_augmented_operands_give_the_biased_linear(m, n, k, bias, pad, placement):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen)
    x[0] *= 1e-4  # a row of tiny activations: the power-of-two scale's lower clamp
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen) if bias else None
    aug = augment_weight(w, ws, b, pad=pad)
    kb0 = -(-k // 128)
    k_aug = {"pad": kb0 * 128, "block": kb0 * 128 + BIAS_TERMS, None: k}[placement]
    assert aug.w.shape == (n, k_aug) and aug.w.stride(0) % (BLOCK_ROW_ALIGN if placement == "block" else ROW_ALIGN) == 0
    assert aug.ws.shape == (ws.shape[0], -(-k_aug // 128))
    assert torch.equal(aug.w[:, :k].float(), w.float())  # |b| / scale fits: no code shifted
    a, xs = augment_activations(x, aug)  # what DeepGemmLinear hands the kernel
    assert a.stride(0) == aug.w.stride(0) and xs.shape == (m, aug.ws.shape[1]) and xs.stride(1) % 4 == 0
    xd = _dequant(a, xs)
    if bias:
        c0, nc = aug.ones
        assert c0 == (k if placement == "pad" else kb0 * 128)
        assert bool((xd[:, c0: c0 + nc] == 1).all())  # the constant is exact
        g = c0 // 128
        assert torch.equal(torch.exp2(torch.log2(xs[:, g]).round()), xs[:, g])  # a power of two
        assert bool((a[:, k: c0].float() == 0).all())
    # the real columns: within e4m3 rounding of x (the bias group's power-of-two scale included)
    assert bool(((xd[:, :k] - x).abs() <= x.abs() * 2.0 ** -4 + xs.repeat_interleave(128, 1)[:, :k] * 2.0 ** -9).all())
    got = xd @ ref.dequantize_fp8_blockwise(aug.w.contiguous(), aug.ws).t()
    want = xd[:, :k] @ ref.dequantize_fp8_blockwise(w, ws).t() + (b if bias else 0)
    tol = 1e-5 if placement == "pad" else 1e-4  # 64 greedy terms vs hi + mid + lo
    assert torch.allclose(got, want, rtol=1e-5, atol=tol * float(want.abs().max()))
    # vs the reference's own quantisation: the power-of-two group rounds differently but not worse
    ref_out = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
    truth = x @ ref.dequantize_fp8_blockwise(w, ws).t() + (b if bias else 0)  # activations unquantised
    rel = lambda u, v: float((u - v).norm() / v.norm())  # noqa: E731
    assert rel(got, ref_out) < 2e-2 and rel(got, truth) < 1.05 * rel(ref_out, truth)


def test_bias_too_large_for_the_block_scale_shifts_the_codes_exactly():
    gen = torch.Generator().manual_seed(7)
    m, n, k = 3, 256, 2880
    x = torch.randn(m, k, generator=gen)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen)
    b[:128] *= 1e3  # block 0: |b| / scale ~ 1e7, far past 448 x 61 columns
    aug = augment_weight(w, ws, b)
    kl = k // 128
    shift = torch.log2(aug.ws[:, kl] / ws[:, kl])
    assert float(shift[0]) >= 1 and float(shift[1]) == 0 and torch.equal(shift, shift.round())
    assert torch.equal(aug.w[128:, :k].float(), w[128:].float()) and torch.equal(aug.w[:, :kl * 128], w[:, :kl * 128])
    a, xs = augment_activations(x, aug)
    xd = _dequant(a, xs)
    got = xd @ ref.dequantize_fp8_blockwise(aug.w.contiguous(), aug.ws).t()
    want = xd[:, :k] @ ref.dequantize_fp8_blockwise(w, ws).t() + b
    # the shifted block's codes lose what falls under e4m3's normal range: tiny next to the bias
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4 * float(want[:, 128:].abs().max()))


def test_ones_group_scale_is_nan_past_the_exact_range():
    x = torch.randn(4, 200)
    x[1, 150] = 3e5  # the ones group's amax beyond 448 * 2^9: the constant cannot be exact
    x[2, 10] = 3e5  # another group: ordinary scaling
    q, s = quantize_act_1x128(x, k_pad=256, ones=(200, 8))
    assert bool(s[1, 1].isnan()) and not bool(s[[0, 2, 3], 1].isnan().any()) and not bool(s[:, 0].isnan().any())


def test_launchers_compile_in_the_augmented_shapes():
    """gpt-oss's projections: QKV's bias in K = 2880's padding (K' = 2944), O's in an extra block
    (K' = 4099, rows 128-byte aligned); each launcher has N and K' compiled in, one per M class."""
    assert placement(2880, True) == ("pad", 2944, 2944, (2880, 64))
    assert placement(4096, True) == ("block", 4099, 4224, (4096, BIAS_TERMS))
    assert placement(4096, False) == (None, 4096, 4096, None)
    tiles = {m: config_for(m, 2880, 4099) for m in (1, 128, 129, 1024, 4095, 4096, 8192)}
    assert {(c.shape_n, c.shape_k) for c in tiles.values()} == {(2880, 4099)}
    shape = {m: (c.block_m, c.block_n) for m, c in tiles.items()}
    assert shape == {1: (64, 64), 128: (64, 64), 129: (128, 192), 1024: (128, 192), 4095: (128, 192),
                     4096: (256, 128), 8192: (256, 128)}  # 256-row tiles under-fill 132 SMs below 4k rows
    assert (config_for(128, 5120, 2944).block_m, config_for(129, 5120, 2944).block_m) == (SMALL.block_m, 256)
    assert config_for(8192, 2880, 4096).block_n == 192  # O without bias: 32 K blocks
    cfgs = launcher_configs([(5120, 2880, True), (2880, 4096, True), (5120, 2880, True)])
    assert len(cfgs) == 5 and {(c.shape_n, c.shape_k) for c in cfgs} == {(5120, 2944), (2880, 4099)}
    assert {config_for(m, n, k) for m in (1, 100, 128, 129, 4095, 4096, 65536)
            for n, k in ((2880, 4099), (5120, 2944))} == set(cfgs)


def test_engine_lists_the_fp8_dense_shapes():
    from engine.build import dense_shapes
    from kernels.registry import make_backends
    from model.config import preset
    from model.gpt_oss import GptOss
    from model.parallel import ParallelConfig

    cfg = preset("tiny")
    be = make_backends("torch", "torch", "torch")
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    fp8 = GptOss(cfg, be, fp8=True, device="meta")
    assert dense_shapes(fp8) == [(q + 2 * kv, cfg.hidden_size, True), (cfg.hidden_size, q, True)]
    assert dense_shapes(GptOss(cfg, be, fp8=True, fp8_attention=False, device="meta")) == []
    # TP2 rank 1: half the heads, and O's bias is added by rank 0 only
    r1 = GptOss(cfg, be, fp8=True, device="meta", parallel=ParallelConfig(tp_size=2, tp_rank=1))
    assert dense_shapes(r1) == [((q + 2 * kv) // 2, cfg.hidden_size, True), (cfg.hidden_size, q // 2, False)]
