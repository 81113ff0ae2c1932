"""The one-token MXFP4 MoE (kernels/moe_mxfp4.py) in the Triton interpreter against kernels.reference.moe on the
dequantised checkpoint weights (model.quant.dequantize_mxfp4): every e2m1 code and a spread of exponents, K tails,
several row tiles and K steps, expert-parallel shares, and the benchmark's CPU smoke."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from kernels import reference as ref
from kernels.moe_mxfp4 import Mxfp4Config, Mxfp4Experts, SmallBatchMxfp4MoE
from model.quant import dequantize_mxfp4

ALPHA, LIMIT = 1.702, 7.0


def _mxfp4(g: torch.Generator, e: int, n: int, k: int, lo: int = 118, hi: int = 126):
    """Random codes (all 16 appear) and exponents in [lo, hi): the checkpoint's [E, N, K/32, 16] / [E, N, K/32]."""
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(lo, hi, (e, n, k // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def _experts(e=8, h=96, i=64, seed=0, dtype=torch.float32, bias2=True):
    g = torch.Generator().manual_seed(seed)
    w1b, w1s = _mxfp4(g, e, 2 * i, h)
    w2b, w2s = _mxfp4(g, e, h, i, 120, 128)
    b1 = torch.randn(e, 2 * i, generator=g).to(dtype)
    b2 = torch.randn(e, h, generator=g).to(dtype) if bias2 else None
    return (w1b, w1s, b1, w2b, w2s, b2)


def _reference(x, logits, top_k, parts, expert_start=0):
    w1b, w1s, b1, w2b, w2s, b2 = parts
    vals, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(vals, dim=-1, dtype=vals.dtype)
    w1 = dequantize_mxfp4(w1b, w1s, torch.float32).to(x.dtype)
    w2 = dequantize_mxfp4(w2b, w2s, torch.float32).to(x.dtype)
    return ref.moe(x, weights, ids, w1, b1, w2, b2, ALPHA, LIMIT, expert_start)


def _run(x, logits, top_k, parts, cfg=None, expert_start=0):
    w = Mxfp4Experts.from_blocks(*parts[:3], *parts[3:], expert_start=expert_start, alpha=ALPHA, limit=LIMIT)
    return SmallBatchMxfp4MoE(cfg)(x, logits, top_k, w)


@pytest.mark.parametrize("t,top_k,h,cfg", [
    (1, 4, 96, Mxfp4Config(block_n1=4, block_n2=4, groups=2)),  # K 96: a full step, then a masked half step
    (1, 2, 64, Mxfp4Config(block_n1=8, block_n2=16, groups=1)),  # one group a step
    (2, 2, 64, Mxfp4Config(block_n1=2, block_n2=8, groups=4)),  # one step wider than K, two tokens
])
def test_mxfp4_moe_fp32_equals_the_dequantised_reference(t, top_k, h, cfg):
    parts = _experts(h=h)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, 8, generator=g)
    got = _run(x, logits, top_k, parts, cfg)
    want = _reference(x, logits, top_k, parts)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


def test_mxfp4_moe_bf16_and_default_tiles():
    """bf16 activations on the default config (4-row tiles, 512-byte steps: here one masked step), against the
    reference in bf16 with the same weights. Loose: the interpreter rounds fp32 -> bf16 toward zero (1 + 2^-8 +
    2^-10 becomes 1.0), so the kernel's five rounding points each shrink it a little (2.3 % here, against the bf16
    reference's 1.1 % from fp32); the GPU rounds to nearest (tests/kernels/test_moe_mxfp4_gpu.py)."""
    parts = _experts(h=64, i=64, dtype=torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 64, generator=g).to(torch.bfloat16)
    logits = torch.randn(1, 8, generator=g).to(torch.bfloat16)
    got = _run(x, logits, 4, parts).float()
    want = _reference(x, logits, 4, parts).float()
    assert (got - want).abs().max() <= 0.04 * want.abs().max(), ((got - want).abs().max(), want.abs().max())


def test_mxfp4_expert_parallel_ranks_sum_to_full():
    """Two expert-parallel ranks of 4 local experts each (another rank's slots skipped in both launches) sum to the
    one-rank output."""
    parts = _experts(e=8, h=64, i=32, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 64, generator=g)
    logits = torch.randn(1, 8, generator=g)
    full = _run(x, logits, 4, parts, Mxfp4Config(groups=2))
    w1b, w1s, b1, w2b, w2s, b2 = parts
    ranks = [_run(x, logits, 4, (w1b[s], w1s[s], b1[s], w2b[s], w2s[s], b2[s]), Mxfp4Config(groups=2),
                  expert_start=s.start) for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(ranks[0] + ranks[1], full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_mxfp4_moe_benchmark_smoke(monkeypatch):
    """benchmarks.moe_mxfp4_b1 runs on CPU (interpreter, no timing, shrunk widths): its rows are there and its own
    checks against the reference pass (no WRONG)."""
    from benchmarks import moe_mxfp4_b1 as bench

    for name, value in (("DEV", "cpu"), ("H", 64), ("I", 64), ("E", 8), ("ACT", torch.float32)):
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "graph_us", lambda fn, reps: (fn(), 1.0)[1])
    rows = bench.moe_rows(1, 1.0, sweep=False)
    assert [r["variant"] for r in rows] == ["fp8 moe_small (default)", "mxfp4 rows 8/8 x 32 groups w4 s3 pdl"]
    assert not any("WRONG" in r["variant"] for r in rows), rows
    # the per-kernel profile's set-up and calls (no CUDA activity on a CPU: no rows), one routing to keep it short
    monkeypatch.setattr(bench, "ROUTINGS", 1)
    assert bench.kernel_rows(1, [Mxfp4Config(dot="f16_lop", prefetch=True)]) == []


def test_mxfp4_gpu_decode_passes_place_every_code():
    """The GPU's PTX decode (kernels/moe_mxfp4._DECODE_ASM, built from DECODE_SHIFTS) emulated on 32-bit words: pass q
    turns codes q and q + 4 of every word into f16s worth the e2m1 value / 2^14 (the interpreter never runs PTX)."""
    import numpy as np

    from kernels.moe_mxfp4 import DECODE_SHIFTS
    from model.quant import FP4_VALUES

    rng = np.random.default_rng(0)
    words = np.concatenate([rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32),
                            np.array([0x11111111 * c for c in range(16)], dtype=np.uint32)])  # every code everywhere
    lut = np.array(FP4_VALUES, dtype=np.float32)
    for q, (op, n) in enumerate(DECODE_SHIFTS):
        t = (words << np.uint32(n)) if op.startswith("shl") else (words >> np.uint32(n))
        h = (t & np.uint32(0x0E000E00)) | ((t << np.uint32(3)) & np.uint32(0x80008000))
        for half, code in ((h & 0xFFFF, q), (h >> 16, q + 4)):
            got = half.astype(np.uint16).view(np.float16).astype(np.float32) * 2.0 ** 14
            want = lut[(words >> np.uint32(4 * code)) & 15]
            np.testing.assert_array_equal(got, want, err_msg=f"pass {q}, code {code}")


def test_model_keeps_mxfp4_experts_and_one_token_steps_take_them(ckpt_factory):
    """tiny-a in fp32, loaded with the checkpoint's MXFP4 experts kept (EngineConfig.mxfp4_experts): the kept blocks
    are the file's; with Fusion.MXFP4_MOE a one-token step's logits equal the torch MoE's on the dequantised experts
    up to fp32 summation order, a prefill chunk's bits do not move (one-token steps only)."""
    from kernels.registry import make_backends
    from model.gpt_oss import GptOss
    from model.config import preset
    from model.loader import load_weights, mxfp4_expert_bytes
    from model.weights import SafetensorsSource
    from tests.support.model_steps import steps_by_setting

    src = SafetensorsSource(ckpt_factory("tiny-a"))
    model = GptOss(src.config, make_backends("torch", "torch", "torch"), dtype=torch.float32, fp8=False)
    load_weights(model, src, progress=False, keep_mxfp4=True)
    mx = model.layers[1].mlp.mx
    kept = sum(t.numel() for layer in model.layers for t in (layer.mlp.mx.w1, layer.mlp.mx.w1_exp, layer.mlp.mx.w2,
                                                             layer.mlp.mx.w2_exp))
    assert kept == mxfp4_expert_bytes(model.cfg, 8)  # what the loader checks against free GPU memory
    assert round(mxfp4_expert_bytes(preset("gpt-oss-20b"), 32) / 1e9, 2) == 10.15
    blocks = src.get("model.layers.1.mlp.experts.down_proj_blocks")
    assert torch.equal(mx.w2.view(blocks.shape), blocks)
    assert torch.equal(mx.w1_exp, src.get("model.layers.1.mlp.experts.gate_up_proj_scales"))
    lens = (13, 1, 1)
    for n, out in zip(lens, steps_by_setting(model, ["off", "mxfp4_moe"], lens, page_size=4, same_kv=True)):
        if n > 1:
            assert torch.equal(out["mxfp4_moe"], out["off"])
        else:
            assert not torch.equal(out["mxfp4_moe"], out["off"])  # engaged: another summation order
            torch.testing.assert_close(out["mxfp4_moe"], out["off"], rtol=1e-4, atol=1e-4)


def _f16_group(words, x, lop: bool):
    """An f16x2 form's two asm blocks (e4m3 conversions, or LOP3 decode) run by tests.support.ptx_emu: words [N, 4]
    uint32 (a group's codes), x [N, 32] float32 (bf16 values) -> [N] group sums in e2m1 x x units."""
    import numpy as np

    from kernels import moe_mxfp4_f16 as m
    from tests.support.ptx_emu import run_asm

    pairs_asm, dot_asm, unit = ((m._LOP_PAIRS_ASM, m._LOP_DOT_ASM, 2.0 ** (14 - m.LOP_X_LOG2)) if lop else
                                (m._F16_PAIRS_ASM, m._F16_DOT_ASM, 2.0 ** 6))
    n = words.shape[0]
    bf16 = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint32)  # x is bf16-exact
    memory = (bf16[:, 0::2] | (bf16[:, 1::2] << 16)).reshape(-1)  # bf16 pairs, word j of group g at 16 (4g + j)
    pairs = run_asm(pairs_asm.value, {4: np.arange(4 * n, dtype=np.int64) * 16}, 4, memory)
    pairs = [p.reshape(n, 4) for p in pairs]  # pair i of word j
    ins = {1 + j: words[:, j] for j in range(4)} | {5 + 4 * j + i: pairs[i][:, j] for j in range(4) for i in range(4)}
    (out,) = run_asm(dot_asm.value, ins, 1)
    return out.view(np.float32).astype(np.float64) * unit


@pytest.mark.parametrize("lop", [False, True], ids=["f16_cvt", "f16_lop"])
def test_mxfp4_f16_forms_asm_emulated(lop):
    """The GPU-only f16x2 forms (Mxfp4Config.dot f16_cvt, f16_lop): their PTX run by a CPU emulator. Every code at
    every position decodes exactly (one x of 1 at a time), and random groups sum to the exact fp64 dot within f16's
    summation error."""
    import numpy as np

    from model.quant import FP4_VALUES

    lut = np.array(FP4_VALUES, dtype=np.float64)
    words = np.array([[0x11111111 * c] * 4 for c in range(16)], dtype=np.uint32)  # code c everywhere
    for pos in range(32):
        x = np.zeros((16, 32), dtype=np.float32)
        x[:, pos] = 1.0
        np.testing.assert_array_equal(_f16_group(words, x, lop), lut, err_msg=f"input {pos}")
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, (4096, 4), dtype=np.uint64).astype(np.uint32)
    x = (rng.standard_normal((4096, 32)) * np.exp2(rng.integers(-6, 10, (4096, 1)))).astype(np.float32)
    x = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 values
    codes = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [N, 4 words, 8 codes]: input 8j + q
    prods = lut[codes.reshape(4096, 32)] * x
    got, want, scale = _f16_group(words, x, lop), prods.sum(axis=1), np.abs(prods).sum(axis=1)
    assert np.all(np.abs(got - want) <= 2e-3 * scale + 1e-30), np.max(np.abs(got - want) / scale)
