"""GPU parity of the FP8 GEMM backends and the Triton MoE at real gpt-oss dims (hidden 2880).

Run this file on its own (the CPU kernel tests set TRITON_INTERPRET=1 at import, which would turn
these kernels into interpreted ones in the same process):
    python -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_alone import GPU_ALONE

pytestmark = GPU_ALONE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_quant_bit_exact_on_gpu():
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    x = torch.randn(4099, 2880, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_act_1x128(x, m_align=4)
    rq, rs = ref.quantize_fp8_per_token(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs) and s.stride() == (1, 4100)


def _linear_backends():
    from kernels.deepgemm_linear import DeepGemmLinear
    from kernels.fp8_gemm import ScaledMMLinear, TritonFp8Linear
    return [("triton", TritonFp8Linear()), ("scaled_mm", ScaledMMLinear()), ("deepgemm", DeepGemmLinear())]


@pytest.mark.parametrize("n,k", [(5120, 2880), (2880, 4096), (1280, 2880)])
@pytest.mark.parametrize("m", [1, 77, 2048])
def test_dense_fp8_backends_match_reference(n: int, k: int, m: int):
    from kernels import reference as ref
    w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for bias in (torch.randn(n, device="cuda", dtype=torch.bfloat16), None):
        want = ref.fp8_linear(x.float(), w, ws, bias, quantize_activations=True)  # fp32
        for name, impl in _linear_backends():
            y = impl(x, w, ws, bias)
            assert y.shape == (m, n) and y.dtype == torch.bfloat16, name
            err = _rel(y, want)
            if name == "deepgemm" and bias is not None and k % 128:
                # bias in the last K block's padding: that group's activation scale is a power of two,
                # so its codes round unlike the reference's. Parity on the operands the kernel reads:
                from kernels.deepgemm_linear import augment_activations, augment_weight
                aug = augment_weight(w, ws, bias)
                a, xs = augment_activations(x, aug)
                exact = ref.dequantize_fp8_per_token(a.contiguous(), xs) @ ref.dequantize_fp8_blockwise(
                    aug.w.contiguous(), aug.ws).t()
                assert _rel(y, exact) < 3e-3 and err < 1e-2, f"{name}: rel err {_rel(y, exact):.2e} / {err:.2e}"
                continue
            assert err < 3e-3, f"{name}: rel err {err:.2e}"


def _experts(e: int, h: int, i: int, fp8: bool, b2: bool = True):
    from kernels import reference as ref
    from kernels.interface import ExpertWeights
    w1 = torch.randn(e, 2 * i, h, device="cuda") * 0.02
    w2 = torch.randn(e, h, i, device="cuda") * 0.02
    b1 = (torch.randn(e, 2 * i, device="cuda") * 0.1).to(torch.bfloat16)
    bb2 = (torch.randn(e, h, device="cuda") * 0.1).to(torch.bfloat16) if b2 else None
    if fp8:
        (q1, s1), (q2, s2) = ref.quantize_fp8_blockwise(w1), ref.quantize_fp8_blockwise(w2)
        return ExpertWeights(q1, s1, b1, q2, s2, bb2, 0, e, 1.702, 7.0)
    return ExpertWeights(w1.to(torch.bfloat16), None, b1, w2.to(torch.bfloat16), None, bb2, 0, e, 1.702, 7.0)


def _moe_reference(x, logits, top_k, w, fp8_acts: bool, act_dtype=torch.float32) -> torch.Tensor:
    """fp32; with fp8_acts, x and the SwiGLU output go through 1x128 e4m3 like the kernels (after
    rounding to act_dtype: tiles without fused re-quantisation store the activation in x.dtype)."""
    from kernels import reference as ref
    from kernels.moe_align import route_topk_softmax
    # The kernels' routing (tested on its own against torch.topk + softmax, ties to the lowest
    # expert): bf16 logits tie often, and torch.topk on CUDA breaks ties its own way.
    weights, ids = route_topk_softmax(logits, top_k)
    q = (lambda a: ref.dequantize_fp8_per_token(*ref.quantize_fp8_per_token(a))) if fp8_acts else (lambda a: a)
    xq = q(x.float())
    out = torch.zeros(x.shape[0], w.w2.shape[1], device=x.device)
    local = ids - w.expert_start
    for e in range(w.num_local):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        w1 = w.w1[e].float() if w.w1_scale is None else ref.dequantize_fp8_blockwise(w.w1[e], w.w1_scale[e])
        w2 = w.w2[e].float() if w.w2_scale is None else ref.dequantize_fp8_blockwise(w.w2[e], w.w2_scale[e])
        a = ref.swiglu(xq[tok] @ w1.t() + w.b1[e].float(), w.alpha, w.limit)
        y = q(a.to(act_dtype).float()) @ w2.t() + (0 if w.b2 is None else w.b2[e].float())
        out.index_add_(0, tok, y.to(x.dtype).float() * weights[tok, slot, None].float())
    return out


@pytest.mark.parametrize("e,t,el,start,inter", [(32, 2048, 32, 0, 2880), (128, 1024, 128, 0, 2880), (32, 1024, 8, 8, 2880),
                                                (32, 2048, 32, 0, 1440), (32, 2048, 32, 0, 720)])
def test_deepgemm_moe_real_dims(e: int, t: int, el: int, start: int, inter: int):
    """DeepGEMM's grouped kernel through our launcher, whole MoE, incl. an EP rank (experts 8..15)
    and TP2/TP4 rank shards of the intermediate (1440, 720: the loader quantises each rank's slice)."""
    import dataclasses

    from kernels.moe_dg import DeepGemmMoE
    w = _experts(e, 2880, inter, fp8=True)
    w = dataclasses.replace(w, w1=w.w1[start:start + el], w1_scale=w.w1_scale[start:start + el],
                            b1=w.b1[start:start + el], w2=w.w2[start:start + el],
                            w2_scale=w.w2_scale[start:start + el], b2=w.b2[start:start + el], expert_start=start)
    x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, e, device="cuda").to(torch.bfloat16)
    out = DeepGemmMoE(min_rows_per_expert=0)(x, logits, 4, w)
    want = _moe_reference(x, logits, 4, w, fp8_acts=True)
    assert _rel(out, want) < 2e-2, _rel(out, want)


@pytest.mark.parametrize("e,t", [(32, 1), (128, 1), (32, 4), (32, 64), (32, 256), (32, 384), (32, 2048), (128, 512)])
def test_fp8_moe_real_dims(e: int, t: int):
    from kernels.moe import TritonMoE
    w = _experts(e, 2880, 2880, fp8=True)
    x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, e, device="cuda").to(torch.bfloat16)
    moe = TritonMoE()
    out = moe(x, logits, 4, w)
    # re-quantisation in the epilogue (always on the few-token path)
    fused = moe.config_for(t, 4, w, True).gemm1.block_n == 256 or t * 4 <= moe.small_max_pairs
    act_dtype = torch.float32 if fused else x.dtype
    assert _rel(out, _moe_reference(x, logits, 4, w, fp8_acts=True, act_dtype=act_dtype)) < 5e-3


@pytest.mark.parametrize("e,t,split", [(32, 2048, 1), (128, 512, 1), (32, 16, 4)])
def test_grouped_fp8_moe_tma_tiles(e: int, t: int, split: int):
    """The grouped path with weight tiles by TMA descriptors (rows past N and the K tail zero-filled
    by the copy engine), whole-K and split-K, at real dims; and equal to per-thread copies."""
    from kernels.moe import TritonMoE
    from kernels.tuning import MoEConfig, TileConfig
    w = _experts(e, 2880, 2880, fp8=True)
    x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, e, device="cuda").to(torch.bfloat16)
    bm = 64 if split == 1 else 16
    tiles = [TileConfig(bm, 256, 128, 8, 4, 3, split), TileConfig(bm, 128, 128, 8, 4, 3, split)]
    plain = TritonMoE(MoEConfig(bm, *tiles), small_max_pairs=0)(x, logits, 4, w)
    tma = [TileConfig(**{**c.to_json(), "tma": True}) for c in tiles]
    out = TritonMoE(MoEConfig(bm, *tma), small_max_pairs=0)(x, logits, 4, w)
    assert _rel(out, _moe_reference(x, logits, 4, w, fp8_acts=True, act_dtype=torch.float32)) < 5e-3
    assert _rel(out, plain) < 1e-3  # same K loop, same rounding points: only fp32 summation order


def test_bf16_moe_real_dims():
    from kernels.moe import TritonMoE
    w = _experts(32, 2880, 2880, fp8=False)
    x = torch.randn(256, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(256, 32, device="cuda").to(torch.bfloat16)
    out = TritonMoE()(x, logits, 4, w)
    assert _rel(out, _moe_reference(x, logits, 4, w, fp8_acts=False)) < 1e-2


def _ep4_outputs(moe, w, x: torch.Tensor, logits: torch.Tensor) -> list[torch.Tensor]:
    """Each of 4 EP ranks' layer output (8 of the 32 experts each, b2 with its expert), in fp32."""
    from kernels.interface import ExpertWeights
    parts = []
    for r in range(4):
        sl = slice(8 * r, 8 * r + 8)
        part = ExpertWeights(w.w1[sl], w.w1_scale[sl], w.b1[sl], w.w2[sl], w.w2_scale[sl], w.b2[sl], 8 * r, 32,
                             1.702, 7.0)
        parts.append(moe(x, logits, 4, part).float())
    return parts


def test_expert_parallel_and_tp_shard_on_gpu():
    """EP4 ranks (8 experts each) sum to the full layer; a TP-style shard (I = 720, b2 None) runs
    with a partial last 1x128 activation group."""
    from kernels.moe import TritonMoE
    w = _experts(32, 2880, 2880, fp8=True)
    x = torch.randn(300, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(300, 32, device="cuda").to(torch.bfloat16)
    moe = TritonMoE()
    parts = _ep4_outputs(moe, w, x, logits)
    assert _rel(sum(parts), _moe_reference(x, logits, 4, w, fp8_acts=True)) < 5e-3
    tp = _experts(32, 2880, 720, fp8=True, b2=False)
    assert _rel(moe(x, logits, 4, tp), _moe_reference(x, logits, 4, tp, fp8_acts=True)) < 5e-3


def _graph_of(call):
    """(CUDA graph of call(), the output tensor it writes): one warm-up run, captured on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            out = call()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def test_moe_decode_cuda_graph():
    from kernels.moe import TritonMoE
    w = _experts(32, 2880, 2880, fp8=True)
    moe = TritonMoE()
    x = torch.randn(8, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(8, 32, device="cuda").to(torch.bfloat16)
    eager = moe(x, logits, 4, w)
    graph, out = _graph_of(lambda: moe(x, logits, 4, w))
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe(x, logits, 4, w)) and not torch.equal(out, eager)


SMALL_VARIANTS = {"mma16": dict(swap_ab=False), "mma16_pdl": dict(swap_ab=False, pdl=True),
                  "swap_ab": dict(swap_ab=True), "swap_ab_pdl": dict(swap_ab=True, pdl=True),
                  "swap_ab_pdl_split2_4": dict(swap_ab=True, pdl=True, split_k1=2, split_k2=4, num_stages=2),
                  "swap_ab_tma_pdl": dict(swap_ab=True, tma=True, pdl=True)}


@pytest.mark.parametrize("variant", list(SMALL_VARIANTS))
def test_few_token_path_ep_tp_and_graph(variant: str):
    """The few-token path (T * top_k <= 8), each MMA orientation, with and without programmatic
    dependent launch: EP ranks sum to the layer, a TP shard (I = 720, b2 None) matches, a CUDA
    graph replays it on new inputs, its counters end at zero."""
    from kernels.moe import TritonMoE
    from kernels.moe_small import SmallBatchMoE, SmallConfig
    w = _experts(32, 2880, 2880, fp8=True)
    x = torch.randn(2, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(2, 32, device="cuda").to(torch.bfloat16)
    moe = TritonMoE()
    moe.small = SmallBatchMoE(SmallConfig(**SMALL_VARIANTS[variant]))
    parts = _ep4_outputs(moe, w, x, logits)
    want = _moe_reference(x, logits, 4, w, fp8_acts=True)  # act re-quantised from fp32
    assert _rel(sum(parts), want) < 5e-3
    tp = _experts(32, 2880, 720, fp8=True, b2=False)
    assert _rel(moe(x, logits, 4, tp), _moe_reference(x, logits, 4, tp, fp8_acts=True)) < 5e-3
    eager = moe(x, logits, 4, w)
    assert torch.equal(eager, moe(x, logits, 4, w)), "deterministic split-K"
    graph, out = _graph_of(lambda: moe(x, logits, 4, w))
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe(x, logits, 4, w)) and not torch.equal(out, eager)
    assert all(int(b.abs().sum()) == 0 for b in moe.small._counters._bufs.values())
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.moe_align import route_topk_softmax
    small = moe.small  # routing and x quantisation fused into gate_up, bit for bit
    g = small.gate_up(x, logits, 4, w, small.config, small._counters.get(4096, x.device))
    wts0, ids0 = route_topk_softmax(logits, 4)
    q0, sc0 = quantize_act_1x128(x)
    assert torch.equal(g.ids, ids0) and torch.equal(g.weights, wts0) and torch.equal(g.xs, sc0)
    assert torch.equal(g.xq.view(torch.uint8), q0.view(torch.uint8))
