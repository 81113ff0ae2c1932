"""The one-token W8A16 FP8 linear (kernels/fp8_rows.py) on CPU through the Triton interpreter against
`reference.fp8_linear(quantize_activations=False)`: both K-step forms, K with a half last 128-block (2880), rows not
a multiple of the program's, bias or none, repeat bits; and the micro-benchmark's call paths."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from kernels import reference as ref
from kernels.fp8_rows import RowsConfig, fp8_rows_linear
from tests.kernels.test_moe import _rel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _linear_case(n: int, k: int, dtype: torch.dtype, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, ws, b


@pytest.mark.parametrize("n,k,bias,cfg", [(192, 2880, True, RowsConfig()), (130, 384, False, RowsConfig()),
                                          (260, 300, True, RowsConfig(block_n=4, block_k=128)),
                                          (136, 2880, False, RowsConfig(block_n=32, block_k=1024)),
                                          (72, 2880, True, RowsConfig(block_k=512)),
                                          (40, 300, False, RowsConfig(block_n=4, block_k=256))])
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


def test_rows_benchmark_smoke(monkeypatch):
    """benchmarks.rows_b1 runs on CPU (interpreter, no timing, shrunk widths): every variant's row is there and
    the rows kernel's outputs pass the benchmark's own reference check (no WRONG)."""
    from benchmarks import rows_b1

    for name, value in (("DEV", "cpu"), ("HQ", 2), ("HKV", 1), ("H", 256), ("STREAM_BYTES", 1)):
        monkeypatch.setattr(rows_b1, name, value)
    monkeypatch.setattr(rows_b1, "graph_us", lambda fn, reps: (fn(), 1.0)[1])
    proj = rows_b1.projection_rows(1, 1.0, sweep=False)
    assert [r["variant"] for r in proj if r["what"] == "qkv"] == [
        "bf16 gemv rows (default)", "fp8 dense_small (fp8_gemv)", "fp8 rows by K 4x512 w4 s3 pdl",
        "fp8 rows 8x512 w4 s3 pdl"]
    assert not any("WRONG" in r["variant"] for r in proj), proj


def test_sass_probe_reads_the_sm90_build(tmp_path):
    """benchmarks.sass_probe compiles the default fp8_rows launches for sm_90a with the launcher's specialisation:
    16-byte weight loads (1-byte loads without the divisibility hints), nothing spilled."""
    from benchmarks.sass_probe import probe_report

    rows = probe_report(["fp8_rows"], tmp_path)
    assert [r["const"]["BLOCK_K"] for r in rows] == [512, 1024]  # config_for: QKV's K 2880, O's 4096
    for r in rows:
        assert r["stack"] == 0 and r["regs"] and r["regs"] <= 128, r
        assert r["ops"].get("LDG.E.128", 0) >= 1 and not any(op.startswith("LDG.E.U8") or "EF.U8" in op
                                                              for op in r["ops"]), r["ops"]
