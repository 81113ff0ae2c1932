"""MXFP4 and FP8 128x128 formats; the converter's report and its refusals."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from kernels.reference import dequantize_fp8_blockwise
from model.quant import FP4_VALUES, dequantize_mxfp4, mxfp4_to_fp8, quantize_mxfp4


def _random_mxfp4(shape_e_n_g, seed=0):
    g = torch.Generator().manual_seed(seed)
    e, n, groups = shape_e_n_g
    blocks = torch.randint(0, 256, (e, n, groups, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (e, n, groups), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequant_bit_exact_with_transformers(dtype):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 40, 4))
    theirs = _convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2).contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_mxfp4_low_nibble_is_even_element():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x3 | (0xA << 4)  # even <- LUT[3] = 1.5, odd <- LUT[10] = -1.0
    w = dequantize_mxfp4(blocks, torch.full((1, 1, 1), 127, dtype=torch.uint8), torch.float32)
    assert w[0, 0, 0].item() == FP4_VALUES[3] and w[0, 0, 1].item() == FP4_VALUES[10]


def test_mxfp4_quantize_round_trip_is_idempotent():
    w = torch.randn(2, 64, 96) * 0.03
    b, s = quantize_mxfp4(w)
    d = dequantize_mxfp4(b, s, torch.float32)
    assert ((d - w).norm() / w.norm()) < 0.2  # 4-bit values: ~12 % RMS error on a Gaussian
    b2, s2 = quantize_mxfp4(d)  # values already on the grid quantise to themselves
    assert torch.equal(dequantize_mxfp4(b2, s2, torch.float32), d)


def test_fp8_conversion_exact_when_spread_small_and_reported_when_not():
    blocks, scales = _random_mxfp4((2, 256, 8))  # exponents 110..134: spread 24 > 14 in most tiles
    narrow = (scales % 10 + 120).to(torch.uint8)  # spread <= 9: exact
    q, s, st = mxfp4_to_fp8(blocks, narrow)
    assert st.inexact_tiles == 0 and st.max_abs_err == 0.0
    ref = dequantize_mxfp4(blocks, narrow, torch.float32)
    assert torch.equal(dequantize_fp8_blockwise(q, s), ref)
    q, s, st = mxfp4_to_fp8(blocks, scales)
    assert 0 < st.inexact_tiles <= st.tiles == 2 * 2 * 2
    ref = dequantize_mxfp4(blocks, scales, torch.float32)
    rel = ((dequantize_fp8_blockwise(q, s) - ref).norm() / ref.norm()).item()
    assert abs(rel - st.rel_err) < 1e-6 and rel < 1e-2  # only values 2^-15 below the tile max are lost


def _tandem(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=300)


def test_convert_cli_reports_and_round_trips(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny-a")
    r = _tandem("convert", "--checkpoint", src, "--out", str(tmp_path / "fp8"))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout[: r.stdout.rindex("}") + 1])
    assert report["experts"]["tiles"] > 0 and report["experts"]["inexact_tiles"] == 0
    assert 0 < report["attention"]["rel_err"] < 0.05
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"


def test_convert_cli_refuses_bad_input(ckpt_factory, tmp_path):
    src = ckpt_factory("tiny-a")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    # Unknown quantisation method.
    (bad / "config.json").write_text(json.dumps(dict(cfg, quantization_config={"quant_method": "gptq"})))
    r = _tandem("convert", "--checkpoint", str(bad), "--out", str(tmp_path / "o1"))
    assert r.returncode == 2 and "quant_method" in r.stderr
    # Wrong shapes: the config claims a wider model than the tensors.
    (bad / "config.json").write_text(json.dumps(dict(cfg, hidden_size=128)))
    r = _tandem("convert", "--checkpoint", str(bad), "--out", str(tmp_path / "o2"))
    assert r.returncode == 2 and "shape" in r.stderr
    # Missing tensors: drop one from the index.
    (bad / "config.json").write_text(json.dumps(cfg))
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    idx["weight_map"].pop("model.layers.1.self_attn.sinks")
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = _tandem("convert", "--checkpoint", str(bad), "--out", str(tmp_path / "o3"))
    assert r.returncode == 2 and "missing" in r.stderr and "sinks" in r.stderr
    # Not a checkpoint at all.
    r = _tandem("convert", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o4"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_activation_scale_is_an_exact_division():
    """scale = amax / 448 correctly rounded (what the Triton quantiser's div_rn computes), not amax
    times a rounded 1/448: on CUDA torch does the latter for a Python-scalar divisor, which flipped
    codes on rounding boundaries against the kernel."""
    from kernels.reference import FP8_MAX, quantize_fp8_per_token

    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 3
    _, scale = quantize_fp8_per_token(x)
    amax = x.abs().reshape(64, 2, 128).amax(-1).double()
    assert torch.equal(scale, (amax / FP8_MAX).float())
