"""FP8 activation quantisation and block-scaled linear backends vs kernels/reference.py, on CPU
through the Triton interpreter (tiny shapes: interpreted kernels are slow)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (no shared conftest on purpose)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common.errors import ConfigError  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.fp8_gemm import (ScaledMMLinear, TritonFp8Linear, _PaddedWeights,  # noqa: E402
                              triton_fp8_gemm)
from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128, round_e4m3  # noqa: E402
from kernels.registry import make_linear  # noqa: E402
from kernels.tuning import TileConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)  # fresh random inputs, the same in every run and order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@triton.jit
def _round_kernel(x_ptr, q_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(q_ptr + o, round_e4m3(tl.load(x_ptr + o)).to(tl.float8e4nv))


def test_round_e4m3_matches_torch_rtne():
    finite = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = finite[torch.isfinite(finite)].unique()  # every e4m3 value
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: must round to even
    gen = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(2000, generator=gen) * s for s in (1e-3, 0.05, 3.0, 100.0)])
    x = torch.cat([grid, mids, rand, mids.nextafter(torch.tensor(0.0))]).clamp(-448, 448)
    n = triton.next_power_of_2(x.numel())
    xp = torch.zeros(n)
    xp[: x.numel()] = x
    q = torch.empty(n, dtype=FP8_DTYPE)
    _round_kernel[(1,)](xp, q, n)
    assert torch.equal(q[: x.numel()].float(), x.to(FP8_DTYPE).float())


def test_round_e4m3_saturates():
    x = torch.tensor([500.0, -1e6, 448.0, -460.0] + [0.0] * 4)
    q = torch.empty(8, dtype=FP8_DTYPE)
    _round_kernel[(1,)](x, q, 8)
    assert q.float()[:4].tolist() == [448.0, -448.0, 448.0, -448.0]


@pytest.mark.parametrize("m,k", [(1, 128), (5, 2880), (33, 300), (3, 130)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_matches_reference(m: int, k: int, dtype: torch.dtype):
    x = (torch.randn(m, k) * 3).to(dtype)
    x[0, :7] = 0  # a zero run inside a group
    if m > 2:
        x[2] = 0  # an all-zero row: floor scale, q = 0
    q, s = quantize_act_1x128(x)
    rq, rs = ref.quantize_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    assert torch.equal(q.float(), rq.float())
    assert torch.equal(s, rs)
    # M-major: a [KB, M] contiguous buffer viewed transposed, as torch._scaled_mm requires.
    assert s.stride() == (1, m) and s.t().is_contiguous()


def test_quant_padding_and_alignment():
    m, k = 7, 300
    x = torch.randn(m, k, dtype=torch.bfloat16)
    q, s = quantize_act_1x128(x, k_pad=128, m_align=4)
    rq, rs = ref.quantize_fp8_per_token(x)
    assert q.shape == (m, 384) and s.shape == (m, 3) and s.stride() == (1, 8)
    assert torch.equal(q[:, :k].float(), rq.float()) and not q[:, k:].float().any()
    assert torch.equal(s, rs)
    q2, s2 = quantize_act_1x128(x, k_pad=512)  # adds a whole zero group: q 0, tiny scale
    assert q2.shape == (m, 512) and s2.shape == (m, 4) and not q2[:, k:].float().any()
    assert torch.equal(s2[:, :3], rs) and bool((s2[:, 3] < 1e-12).all())


def _weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return ref.quantize_fp8_blockwise(torch.randn(n, k, generator=gen) * 0.05)


CONFIGS = [None, TileConfig(32, 64, 64, 2, 4, 2), TileConfig(16, 32, 128, 1, 4, 2),
           TileConfig(16, 256, 128, 4, 8, 3)]


@pytest.mark.parametrize("m,n,k", [(5, 256, 2880), (37, 200, 300), (1, 128, 128), (20, 384, 200)])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "bk64", "bn32", "bn256"])
def test_triton_gemm_fp32_tight(m: int, n: int, k: int, cfg: TileConfig | None):
    x = torch.randn(m, k)
    w, ws = _weights(n, k)
    b = torch.randn(n)
    xq, xs = quantize_act_1x128(x)
    y = triton_fp8_gemm(xq, xs, w, ws, b, torch.float32, cfg)
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
    assert _rel(y, want) < 1e-5
    assert (y - want).abs().max() < 1e-4 * want.abs().max()


@pytest.mark.parametrize("has_bias", [True, False])
def test_triton_linear_bf16(has_bias: bool):
    x = torch.randn(2, 3, 2880, dtype=torch.bfloat16)  # leading dims are kept
    w, ws = _weights(200, 2880, seed=1)
    b = torch.randn(200, dtype=torch.bfloat16) if has_bias else None
    y = TritonFp8Linear()(x, w, ws, b)
    want = ref.fp8_linear(x.reshape(6, 2880), w, ws, b, quantize_activations=True).reshape(2, 3, 200)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 200)
    # Same fp32 sum, one bf16 rounding each (the interpreter's cast truncates): <= ~1 bf16 ulp.
    assert _rel(y, want) < 8e-3
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-3).all()
    # Against unquantised activations the gap is the 1x128 e4m3 rounding: a few percent at most.
    exact = ref.fp8_linear(x.reshape(6, 2880), w, ws, b, quantize_activations=False).reshape(2, 3, 200)
    assert 1e-3 < _rel(y, exact) < 5e-2


@pytest.mark.parametrize("impl", [TritonFp8Linear(), ScaledMMLinear()])
def test_native_weights_fall_back_to_matmul(impl):
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    w = torch.randn(64, 96, dtype=torch.bfloat16)
    b = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(impl(x, w, None, b), F.linear(x, w, b))


def test_scaled_mm_operand_layouts_and_cpu_path():
    """The operands ScaledMMLinear hands torch._scaled_mm meet its 1x128 / 128x128 checks
    (ATen ScaledBlas.cpp: scale_a (M, K/128) strides (1, M); scale_b.t() (N/128, K/128) strides
    (K/128, 1)), and reading them the way cuBLASLt does gives the reference result."""
    m, n, k = 9, 256, 2880
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w, ws = _weights(n, k, seed=2)
    b = torch.randn(n, dtype=torch.bfloat16)
    xq, xs = quantize_act_1x128(x)
    a, bm, sa, sb = xq, w.t(), xs, ws.t()
    kb, nb = -(-k // 128), -(-n // 128)
    assert sa.shape == (m, kb) and sa.stride() == (1, m)
    assert sb.t().shape == (nb, kb) and sb.t().stride() == (kb, 1)
    assert bm.stride() == (1, k)  # column-major B
    a_deq = a.float() * sa.repeat_interleave(128, dim=1)[:, :k]
    b_deq = bm.float() * sb.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    emulated = (a_deq @ b_deq + b.float()).to(torch.bfloat16)
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
    assert _rel(emulated, want) < 4e-3
    assert torch.equal(ScaledMMLinear()(x, w, ws, b), want)  # CPU: the same function via reference


def test_padded_weights_zero_fill_and_cache():
    w, ws = _weights(130, 300, seed=3)
    cache = _PaddedWeights()
    wp, wsp = cache.get(w, ws, 512)
    assert wp.shape == (130, 512) and wsp.shape == (2, 4)
    assert torch.equal(wp[:, :300].float(), w.float()) and not wp[:, 300:].float().any()
    assert torch.equal(wsp[:, :3], ws) and bool((wsp[:, 3] == 1).all())
    assert cache.get(w, ws, 512)[0] is wp  # cached for the same weight object
    other = w[:]  # same address, another tensor object: never served from the cache
    assert cache.get(other, ws, 512)[0] is not wp
    assert cache.get(w, ws, 300)[0] is w  # no padding needed: the weight itself


def test_deepgemm_without_headers_or_nvcc_raises_config_error(monkeypatch, tmp_path):
    import importlib.util

    from kernels import deepgemm_sm90 as dg
    monkeypatch.delenv("TANDEM_DEEPGEMM_INCLUDE", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="DeepGEMM headers not found"):
        dg.include_dir()
    monkeypatch.setenv("TANDEM_DEEPGEMM_INCLUDE", str(tmp_path))  # headers "found", cache empty
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    monkeypatch.delenv("NVCC", raising=False)
    (tmp_path / "VERSION").write_text("0")
    with pytest.raises(ConfigError, match="nvcc not found"):
        dg.library_path(dg.DgConfig(), 132)
    assert not dg.library_path(dg.DgConfig(), 132, build=False).exists()


def test_deepgemm_tile_config():
    from kernels import deepgemm_sm90 as dg
    assert dg.DgConfig(128, 160).swizzle_d() == 64 and dg.DgConfig(128, 192).swizzle_d() == 128
    assert dg.DgConfig(128, 128).resolved_stages() == 5  # 227 KB of shared memory
    assert dg.DgConfig(128, 192).resolved_stages() == 4
    assert dg.DgConfig(256, 128).resolved_stages() == 3
    flags = dg.build_flags(dg.DgConfig(128, 160, mcast=2, gemm_type=dg.GROUPED), 132)
    assert "-DTD_MCAST=2" in flags and "-DTD_GEMM_TYPE=1" in flags and "-DTD_NUM_SMS=132" in flags


def test_registry_builds_fp8_linears():
    assert isinstance(make_linear("triton"), TritonFp8Linear)
    assert isinstance(make_linear("scaled_mm"), ScaledMMLinear)
    assert make_linear("deepgemm").name == "deepgemm"  # built lazily: no GPU or nvcc needed yet
