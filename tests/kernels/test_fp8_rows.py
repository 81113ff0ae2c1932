"""The one-token W8A16 kernels on CPU through the Triton interpreter: the FP8 whole-rows linear
(kernels/fp8_rows.py) against `reference.fp8_linear(quantize_activations=False)`, and the rows MoE
(kernels/moe_rows.py) against the torch MoE on the dequantised experts (x and act unquantised): K with a half
last 128-block (2880), rows not a multiple of the program's, bias or none, EP ranks, top_k padding, repeat bits."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from kernels import reference as ref
from kernels.fp8_rows import RowsConfig, fp8_rows_linear
from kernels.interface import ExpertWeights
from kernels.moe_rows import MoERowsConfig, moe_rows
from kernels.torch_backend import TorchMoE
from tests.kernels.test_moe import _experts, _fp8_act_reference, _logits, _rel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _linear_case(n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, ws, b


@pytest.mark.parametrize("n,k,bias,cfg", [(192, 2880, True, RowsConfig()), (130, 384, False, RowsConfig()),
                                          (260, 300, True, RowsConfig(block_n=4, unroll=1)),
                                          (136, 2880, False, RowsConfig(block_n=32, unroll=3)),
                                          (72, 2880, True, RowsConfig(block_k=512)), (40, 300, False, RowsConfig(block_n=4, block_k=256))])
def test_linear_fp32_tight_vs_reference(n, k, bias, cfg):
    x, w, ws, b = _linear_case(n, k, torch.float32, seed=n + k, bias=bias)
    y = fp8_rows_linear(x, w, ws, b, cfg)
    assert y.shape == (1, n) and y.dtype == torch.float32
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=False)
    assert _rel(y, want) < 1e-6
    # x is NOT quantised: the W8A8 reference is a different (coarser) result
    assert _rel(y, ref.fp8_linear(x, w, ws, b, quantize_activations=True)) > 1e-4
    assert torch.equal(y, fp8_rows_linear(x, w, ws, b, cfg)), "one summation order: the same bits every call"


def test_linear_bf16():
    x, w, ws, b = _linear_case(192, 2880, torch.bfloat16, seed=3, bias=True)
    y = fp8_rows_linear(x, w, ws, b)
    assert y.dtype == torch.bfloat16
    # one rounding of the fp32 sum (the interpreter rounds to nearest even like the GPU: gemv's _round_out)
    want = ref.fp8_linear(x, w, ws, b, quantize_activations=False)
    assert _rel(y, want) < 5e-3


def test_linear_rejects_tokens_and_bad_blocks():
    x, w, ws, b = _linear_case(128, 256, torch.float32, seed=1, bias=False)
    with pytest.raises(AssertionError, match="one"):
        fp8_rows_linear(torch.cat([x, x]), w, ws, b)
    with pytest.raises(AssertionError, match="scale block"):
        fp8_rows_linear(x, w, ws, b, RowsConfig(block_n=48))


def _w8a16(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights) -> torch.Tensor:
    """The torch MoE on fp32-dequantised experts: x and the SwiGLU output unquantised (W8A16)."""
    return TorchMoE()(x, logits, top_k, w)


@pytest.mark.parametrize("t,top_k,h,i,cfg", [
    (1, 4, 160, 128, MoERowsConfig()),
    (1, 4, 2880, 64, MoERowsConfig()),  # 2880 = 22.5 x 128: half last K block of W1, half last row block of W2
    (2, 3, 136, 72, MoERowsConfig(block_n1=4, unroll1=1, block_n2=16, unroll2=1)),  # top_k padded to 4
    (1, 1, 96, 40, MoERowsConfig(block_n2=4, unroll2=2)),
])
def test_moe_fp32_tight_vs_w8a16_reference(t, top_k, h, i, cfg):
    e = 8
    w = _experts(e, e, h, i, torch.float32, fp8=True, seed=t + top_k)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(h))
    logits = _logits(t, e, torch.float32, seed=t)
    out = moe_rows(x, logits, top_k, w, cfg)
    assert out.shape == (t, h) and out.dtype == torch.float32
    assert _rel(out, _w8a16(x, logits, top_k, w)) < 1e-5
    assert _rel(out, _fp8_act_reference(x, logits, top_k, w)) > 1e-4, "x and act are not quantised"
    assert torch.equal(out, moe_rows(x, logits, top_k, w, cfg)), "fixed orders: the same bits every call"


def test_moe_expert_parallel_ranks_sum_to_full_and_b2_none():
    t, e, h, i = 2, 8, 160, 128
    full = _experts(e, e, h, i, torch.float32, fp8=True, seed=9)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(9))
    logits = _logits(t, e, torch.float32, seed=9)
    total = moe_rows(x, logits, 4, full)
    parts = []
    for start in (0, 3, 6):  # uneven ranges; a rank may own no selected slot
        sl = slice(start, min(start + 3, e))
        part = ExpertWeights(full.w1[sl], full.w1_scale[sl], full.b1[sl], full.w2[sl], full.w2_scale[sl],
                             full.b2[sl], start, e, 1.702, 7.0)
        parts.append(moe_rows(x, logits, 4, part))
    assert _rel(sum(parts), total) < 1e-6
    nob2 = ExpertWeights(full.w1, full.w1_scale, full.b1, full.w2, full.w2_scale, None, 0, e, 1.702, 7.0)
    assert _rel(moe_rows(x, logits, 4, nob2), _w8a16(x, logits, 4, nob2)) < 1e-5
    none_local = ExpertWeights(full.w1[:2], full.w1_scale[:2], full.b1[:2], full.w2[:2], full.w2_scale[:2],
                               full.b2[:2], 0, e, 1.702, 7.0)
    only_late = logits.clone()
    only_late[:, 0:2] -= 1000.0  # experts 0 and 1 never selected
    assert torch.count_nonzero(moe_rows(x, only_late, 2, none_local)) == 0


def test_moe_bf16_close_to_the_bf16_reference():
    t, e, h, i = 1, 8, 2880, 128
    w = _experts(e, e, h, i, torch.bfloat16, fp8=True, seed=2)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits = _logits(t, e, torch.bfloat16, seed=2)
    out = moe_rows(x, logits, 4, w)
    assert out.dtype == torch.bfloat16
    # The reference rounds the dequantised weights and every SwiGLU op to bf16; the kernel keeps fp32 between its
    # rounding points (the linear's output, act, y, y * weight), which the interpreter truncates where the GPU
    # rounds (one-sided, as in test_moe_small's bf16 test). bf16 at real widths on the GPU: test_fp8_rows_gpu.py.
    assert _rel(out, _w8a16(x, logits, 4, w)) < 4e-2


def test_rows_benchmark_smoke(monkeypatch):
    """benchmarks.rows_b1's sections run on CPU (interpreter, no timing, shrunk widths): every variant's row is
    there and the rows kernels' outputs pass the benchmark's own reference checks (no WRONG)."""
    import benchmarks.moe as bm
    from benchmarks import rows_b1

    for mod, name, value in ((rows_b1, "DEV", "cpu"), (bm, "DEVICE", "cpu"), (rows_b1, "HQ", 2),
                             (rows_b1, "HKV", 1), (rows_b1, "H", 256), (rows_b1, "E", 8),
                             (rows_b1, "STREAM_BYTES", 1), (bm, "H", 256), (bm, "I", 128)):
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(rows_b1, "_us", lambda fn, reps: (fn(), 1.0)[1])
    proj = rows_b1.projection_rows(1, 1.0, sweep=False)
    assert [r["variant"] for r in proj if r["what"] == "qkv"] == [
        "bf16 gemv rows (default)", "fp8 dense_small (fp8_gemv)", "fp8 rows 8x128 u8 w4 s3 pdl"]
    moe = rows_b1.moe_rows_section(1, 1.0, sweep=False)
    assert len(moe) == 3 and moe[-1]["variant"].startswith("moe_rows")
    assert not any("WRONG" in r["variant"] for r in proj + moe), proj + moe
