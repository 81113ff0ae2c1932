"""The few-token FP8 MoE path (kernels/moe_small.py) vs the reference and the grouped path, on CPU
through the Triton interpreter: split-K with last-CTA fix-up, fused down + combine, EP, b2 None."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest
import torch

from kernels.interface import ExpertWeights
from kernels.moe import TritonMoE
from kernels.moe_small import SmallBatchMoE, SmallConfig, choose_split
from kernels.torch_backend import TorchMoE
from tests.kernels.test_moe import _experts, _fp8_act_reference, _logits, _rel

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(4321)


def _counters_zero(moe: SmallBatchMoE) -> bool:
    return all(int(b.abs().sum()) == 0 for b in moe._counters._bufs.values())


VARIANTS = {"mma16": dict(swap_ab=False), "swap_ab": dict(swap_ab=True), "swap_ab_tma": dict(swap_ab=True, tma=True)}


# Every (split, variant) pair at one token; at three tokens (~4-10 s each in the interpreter) a
# Latin square, so each split and each variant still runs with several tokens.
CASES = [(1, 160, 128, split, variant) for split in (0, 1, 3) for variant in VARIANTS] + [
    (3, 256, 96, 3, "swap_ab_tma"), (3, 256, 96, 1, "mma16"), (3, 256, 96, 0, "swap_ab")]


@pytest.mark.parametrize("t,h,i,split,variant", CASES)
def test_fp32_tight_vs_reference(split: int, t: int, h: int, i: int, variant: str):
    e = 8
    w = _experts(e, e, h, i, torch.float32, fp8=True, seed=t)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=t)
    moe = SmallBatchMoE(SmallConfig(block_n2=32, split_k1=split, split_k2=split, **VARIANTS[variant]))
    out = moe(x, logits, 4, w)
    assert out.shape == (t, h) and out.dtype == torch.float32
    assert _rel(out, _fp8_act_reference(x, logits, 4, w)) < 1e-3
    assert _rel(out, TorchMoE()(x, logits, 4, w)) < 6e-2  # FP8 activation error vs exact acts
    assert _counters_zero(moe), "every counter is reset by the CTA that consumed it"
    again = moe(x, logits, 4, w)
    assert torch.equal(out, again), "split-K sums run in split order: bit-identical reruns"


def test_bf16_hidden_2880():
    t, e, h, i = 1, 4, 2880, 128  # 2880 = 22.5 x 128: the last K block is half
    w = _experts(e, e, h, i, torch.bfloat16, fp8=True, seed=1)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    logits = _logits(t, e, torch.bfloat16, seed=1)
    small = TritonMoE()(x, logits, 2, w)  # 2 pairs: dispatched to the few-token path
    grouped = TritonMoE(small_max_pairs=0)(x, logits, 2, w)
    assert small.dtype == torch.bfloat16
    assert _rel(small, grouped) < 1e-2  # the same K loop and rounding points
    # The interpreter truncates fp32 -> bf16 (the GPU rounds): ~0.4% one-sided at each of four
    # roundings, and a truncated act can move an e4m3 code. The fp32 tests above are the tight ones.
    # bf16 on the GPU is tested at real dims in test_gemm_moe_gpu.py.
    want = _fp8_act_reference(x, logits, 2, w)
    assert _rel(small, want) < 4e-2 and _rel(grouped, want) < 4e-2


def _two_tokens(variant: str, seed: int) -> tuple[ExpertWeights, torch.Tensor, torch.Tensor, SmallBatchMoE]:
    """2 tokens over 8 fp32-mastered FP8 experts (h 160, i 128), split K in both launches."""
    t, e, h, i = 2, 8, 160, 128
    w = _experts(e, e, h, i, torch.float32, fp8=True, seed=seed)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=seed)
    return w, x, logits, SmallBatchMoE(SmallConfig(block_n2=64, split_k1=2, split_k2=2, **VARIANTS[variant]))


@pytest.mark.parametrize("variant", ["mma16", "swap_ab_tma"])  # the two tile kinds' skip paths
def test_expert_parallel_ranks_sum_to_full_and_b2_none(variant: str):
    full, x, logits, moe = _two_tokens(variant, seed=3)
    e = full.num_experts
    total = moe(x, logits, 4, full)
    parts = []
    for start in (0, 3, 6):  # uneven ranges; the last rank (experts 6, 7) may own no selected slot
        sl = slice(start, min(start + 3, e))
        part = ExpertWeights(full.w1[sl], full.w1_scale[sl], full.b1[sl], full.w2[sl], full.w2_scale[sl],
                             full.b2[sl], start, e, 1.702, 7.0)
        parts.append(moe(x, logits, 4, part))
    assert _rel(sum(parts), total) < 1e-5
    nob2 = ExpertWeights(full.w1, full.w1_scale, full.b1, full.w2, full.w2_scale, None, 0, e, 1.702, 7.0)
    assert _rel(moe(x, logits, 4, nob2), _fp8_act_reference(x, logits, 4, nob2)) < 1e-3
    assert _counters_zero(moe)


def test_no_local_expert_gives_zeros_and_one_expert_for_all():
    t, e, h, i = 3, 8, 160, 64
    w = _experts(e, e, h, i, torch.float32, fp8=True, seed=5)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=5)
    logits[:, 5] += 100.0  # expert 5 first for every token
    moe = SmallBatchMoE(SmallConfig(block_n2=64))
    assert _rel(moe(x, logits, 1, w), _fp8_act_reference(x, logits, 1, w)) < 1e-3
    none_local = ExpertWeights(w.w1[:2], w.w1_scale[:2], w.b1[:2], w.w2[:2], w.w2_scale[:2], w.b2[:2],
                               0, e, 1.702, 7.0)
    only5 = logits.clone()
    only5[:, 0:2] -= 1000.0  # experts 0 and 1 never selected at top-2
    assert torch.count_nonzero(moe(x, only5, 2, none_local)) == 0
    assert _counters_zero(moe)


def test_dispatch_and_split_choice():
    assert choose_split(tiles=180, k=2880, num_sms=132, ctas_per_sm=3, fixed=0) == 2
    assert choose_split(tiles=4 * 23, k=2880, num_sms=132, ctas_per_sm=3, fixed=0) == 4
    assert choose_split(tiles=4000, k=2880, num_sms=132, ctas_per_sm=3, fixed=0) == 1
    assert choose_split(tiles=1, k=256, num_sms=132, ctas_per_sm=3, fixed=0) == 1  # >= 2 K blocks each
    assert choose_split(tiles=92, k=2880, num_sms=132, ctas_per_sm=3, fixed=2) == 2  # tuned: stands
    # A fixed split that leaves SMs idle (a TP-sharded expert: few N tiles) yields to the rule.
    assert choose_split(tiles=24, k=2880, num_sms=132, ctas_per_sm=3, fixed=2) == 11
    from kernels.moe_small import DEFAULT_SMALL_CONFIGS
    assert SmallBatchMoE.config_for(4) is DEFAULT_SMALL_CONFIGS[0][1]
    assert SmallBatchMoE.config_for(8) is DEFAULT_SMALL_CONFIGS[1][1]
    e, h, i = 8, 160, 64
    w = _experts(e, e, h, i, torch.float32, fp8=True, seed=6)
    x = torch.randn(5, h)
    logits = _logits(5, e, torch.float32, seed=6)
    moe = TritonMoE()
    calls = []
    moe.small = lambda *a: calls.append(1) or SmallBatchMoE()(*a)
    moe(x[:2], logits[:2], 4, w)  # 8 pairs: few-token path
    moe(x[:3], logits[:3], 4, w)  # 12 pairs: grouped path
    assert calls == [1]


@pytest.mark.parametrize("split", [1, 2, 3])
def test_fused_routing_and_quantisation_match_the_separate_kernels(split: int):
    """gate_up routes each token and quantises x over its CTAs' K ranges: the ids, weights, e4m3 x
    and scales it leaves equal route_topk_softmax and quantize_act_1x128 bit for bit, with EP ranks
    owning none of a token's experts too (their CTAs return after routing)."""
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.interface import ExpertWeights
    from kernels.moe_align import route_topk_softmax
    for t, e, h in ((1, 32, 2880), (3, 128, 160)):
        x = torch.randn(t, h, dtype=torch.bfloat16) * 3
        logits = _logits(t, e, torch.bfloat16, seed=t)
        full = _experts(e, e, h, 128, torch.bfloat16, fp8=True, seed=t)
        none_local = ExpertWeights(full.w1[:1], full.w1_scale[:1], full.b1[:1], full.w2[:1], full.w2_scale[:1],
                                   full.b2[:1], e, e + 1, 1.702, 7.0)  # owns an expert id nobody picks
        w0, ids0 = route_topk_softmax(logits, 4)
        q0, s0 = quantize_act_1x128(x)
        for w in (full, none_local):
            moe = SmallBatchMoE(SmallConfig(split_k1=split, split_k2=1, block_n2=64))
            g = moe.gate_up(x, logits, 4, w, moe.config, moe._counters.get(1024, x.device))
            assert torch.equal(g.ids, ids0) and torch.equal(g.weights, w0)
            # every CTA quantises its K range before checking whether its expert is local
            assert torch.equal(g.xq.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(g.xs, s0)
            assert g.xs.stride() == s0.stride()


def test_ep_split_scale_splits_finer_and_stays_exact():
    """ep_split_scale: an EP rank owning El of E experts splits K ~E/El times finer (capped at half
    the K blocks); its ranks still sum to the full layer."""
    t, e, h, i = 1, 8, 1024, 128
    full = _experts(e, e, h, i, torch.float32, fp8=True, seed=9)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=9)
    cfg = SmallConfig(block_n2=64, split_k1=1, split_k2=1, swap_ab=True)
    total = SmallBatchMoE(cfg)(x, logits, 4, full)
    moe = SmallBatchMoE(cfg, ep_split_scale=True)
    parts = []
    for start in (0, 4):
        sl = slice(start, start + 4)
        part = ExpertWeights(full.w1[sl], full.w1_scale[sl], full.b1[sl], full.w2[sl], full.w2_scale[sl],
                             full.b2[sl], start, e, 1.702, 7.0)
        assert moe._split(8, h, x.device, cfg, 1, part) == 2  # 1 x E/El = 2 (K = 8 blocks: cap 4)
        assert moe._split(8, h, x.device, cfg, 1, full) == 1  # all experts local: unchanged
        parts.append(moe(x, logits, 4, part))
    assert _rel(sum(parts), total) < 1e-5
    assert _counters_zero(moe)


@pytest.mark.parametrize("variant", ["mma16", "swap_ab_tma"])
def test_x_quantised_by_the_norm_gives_the_same_bits(variant: str):
    """x_fp8 (x in e4m3 1x128 groups, as the fused norm writes it): gate_up's CTAs skip their own quantisation
    (b1-probes-2: ~2 us of 35 at one token) and the layer's output keeps its bits; TritonMoE passes it through."""
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.norm import fused_norm

    w, x, logits, moe = _two_tokens(variant, seed=7)
    t, h = x.shape
    want = moe(x, logits, 4, w)
    assert torch.equal(moe(x, logits, 4, w, quantize_act_1x128(x)), want)
    n = fused_norm(x, None, torch.ones(h), 1e-5, quant=True)  # the norm's copy of its output y
    assert torch.equal(moe(n.y, logits, 4, w, (n.yq, n.ys)), moe(n.y, logits, 4, w))
    triton_moe = TritonMoE()
    assert triton_moe.takes_fp8_input(t, 2, w)
    assert torch.equal(triton_moe(n.y, logits, 2, w, (n.yq, n.ys)), triton_moe(n.y, logits, 2, w))
    assert _counters_zero(moe)
