"""Triton MoE (routing, grouping, grouped FP8/native expert GEMMs, combine) vs kernels/reference.py,
on CPU through the Triton interpreter. Tiny shapes; hidden sizes not a multiple of 128 included."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (no shared conftest on purpose)

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.interface import ExpertWeights  # noqa: E402
from kernels.moe import TritonMoE  # noqa: E402
from kernels import moe_align  # noqa: E402
from kernels.moe_align import align_by_expert, max_row_blocks, route_topk_softmax  # noqa: E402
from kernels.registry import make_moe  # noqa: E402
from kernels.torch_backend import TorchMoE  # noqa: E402
from kernels.tuning import MoEConfig, TileConfig, default_moe_config, load_table, moe_config  # noqa: E402

# Padding rows of the grouped buffers are never written; the interpreter's numpy may warn on them.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)  # fresh random inputs, the same in every run and order


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _logits(t: int, e: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Each row a permutation of multiples of 1/16 in [-E/32, E/32): distinct and exact in bf16, so
    top-k has no ties in any dtype."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(e, generator=gen) for _ in range(t)]
    return ((torch.stack(rows).float() - e / 2) / 16).reshape(t, e).to(dtype)


def _experts(e: int, el: int, h: int, i: int, dtype: torch.dtype, fp8: bool, start: int = 0,
             b2: bool = True, seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(el, 2 * i, h, generator=gen) * 0.06
    w2 = torch.randn(el, h, i, generator=gen) * 0.06
    b1 = (torch.randn(el, 2 * i, generator=gen) * 0.2).to(dtype)
    bb2 = (torch.randn(el, h, generator=gen) * 0.2).to(dtype) if b2 else None
    if fp8:
        w1q, w1s = ref.quantize_fp8_blockwise(w1)
        w2q, w2s = ref.quantize_fp8_blockwise(w2)
        return ExpertWeights(w1q, w1s, b1, w2q, w2s, bb2, start, e, 1.702, 7.0)
    return ExpertWeights(w1.to(dtype), None, b1, w2.to(dtype), None, bb2, start, e, 1.702, 7.0)


def _fp8_act_reference(x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights,
                       gemm_out_bf16: bool = False) -> torch.Tensor:
    """What the FP8 kernels compute: reference routing; x and the SwiGLU output through 1x128 e4m3
    quantisation; fp32 GEMMs with dequantised weights; y rounded to x.dtype, then * weight.
    gemm_out_bf16: both GEMM outputs leave as bf16 before their bias is added (kernels/moe_dg.py)."""
    vals, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(vals, dim=-1, dtype=vals.dtype)
    q = lambda a: ref.dequantize_fp8_per_token(*ref.quantize_fp8_per_token(a))  # noqa: E731
    out_round = (lambda a: a.to(torch.bfloat16).float()) if gemm_out_bf16 else (lambda a: a)  # noqa: E731
    w1 = ref.dequantize_fp8_blockwise(w.w1, w.w1_scale)
    w2 = ref.dequantize_fp8_blockwise(w.w2, w.w2_scale)
    xq = q(x)
    out = torch.zeros(x.shape[0], w2.shape[1])
    local = ids - w.expert_start
    for e in range(w.num_local):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        a = ref.swiglu(out_round(xq[tok] @ w1[e].t()) + w.b1[e].float(), w.alpha, w.limit)
        y = out_round(q(a) @ w2[e].t()) + (0 if w.b2 is None else w.b2[e].float())
        out.index_add_(0, tok, (y.to(x.dtype) * weights[tok, slot, None]).float())
    return out.to(x.dtype)


# ---- routing ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,e,k", [(7, 32, 4), (20, 128, 4), (3, 5, 2), (4, 8, 1), (5, 16, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_softmax_matches_reference(t: int, e: int, k: int, dtype: torch.dtype):
    logits = _logits(t, e, dtype)
    w, ids = route_topk_softmax(logits, k)
    vals, want_ids = torch.topk(logits, k, dim=-1)
    want = torch.softmax(vals, dim=-1, dtype=vals.dtype)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert w.dtype == dtype
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6  # one bf16 ulp (interpreter truncates)
    assert (w.float() - want.float()).abs().max() <= tol


def test_topk_ties_pick_lowest_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0, 2.0]])
    w, ids = route_topk_softmax(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 6]]
    assert torch.allclose(w.sum(-1), torch.ones(1))
    # Negative logits, -0.0 equal to +0.0 (lowest id first), -inf never picked before a finite one.
    logits = torch.tensor([[-3.0, 0.0, -0.0, float("-inf"), -0.5, -3.0]])
    w, ids = route_topk_softmax(logits, 4)
    assert ids.tolist() == [[1, 2, 4, 0]]
    assert torch.allclose(w, torch.softmax(logits[:, [1, 2, 4, 0]], -1))


# ---- grouping --------------------------------------------------------------------------------------
def _check_grouping(ids: torch.Tensor, start: int, el: int, bm: int) -> None:
    g = align_by_expert(ids, start, el, bm)
    p = ids.numel()
    n = int(g.num_rows.item())
    local = ids.reshape(-1).long() - start
    valid = (local >= 0) & (local < el)
    counts = torch.bincount(local[valid], minlength=el)
    assert n == int(((counts + bm - 1) // bm * bm).sum()) and n <= g.max_blocks * bm
    assert g.max_blocks == max(1, max_row_blocks(p, el, bm))
    seen = []
    for r in range(n):
        pair = int(g.sorted_pairs[r])
        e = int(g.block_expert[r // bm])
        assert 0 <= e < el
        if pair != p:
            assert int(local[pair]) == e
            seen.append(pair)
    assert sorted(seen) == torch.nonzero(valid).flatten().tolist()  # each local pair exactly once
    assert bool((g.block_expert[n // bm:] == -1).all())
    assert bool((g.sorted_pairs[n:] == p).all())  # unused tiles are padding too (the gather reads them)
    blocks = g.block_expert[: n // bm].tolist()
    assert blocks == sorted(blocks)  # contiguous segments in expert order; empty experts absent


@pytest.mark.parametrize("t,k,el,start,e_total,bm", [
    (7, 4, 8, 0, 8, 16),        # every expert local
    (100, 4, 8, 8, 16, 16),     # EP rank 1 of 2: half the pairs belong elsewhere
    (1, 4, 32, 0, 32, 16),      # decode: 28 experts without tokens
    (300, 4, 4, 2, 8, 32),      # middle expert range
    (50, 1, 8, 0, 8, 16),       # top-1
])
@pytest.mark.parametrize("parallel", [False, True], ids=["one-program", "many-programs"])
def test_grouping(t: int, k: int, el: int, start: int, e_total: int, bm: int, parallel: bool, monkeypatch):
    monkeypatch.setattr(moe_align, "PARALLEL_MIN_PAIRS", 0 if parallel else 1 << 30)
    gen = torch.Generator().manual_seed(t)
    _check_grouping(torch.randint(0, e_total, (t, k), generator=gen, dtype=torch.int32), start, el, bm)


@pytest.mark.parametrize("parallel", [False, True], ids=["one-program", "many-programs"])
def test_grouping_all_tokens_one_expert_and_none_local(parallel: bool, monkeypatch):
    monkeypatch.setattr(moe_align, "PARALLEL_MIN_PAIRS", 0 if parallel else 1 << 30)
    _check_grouping(torch.full((37, 1), 3, dtype=torch.int32), 0, 8, 16)
    g = align_by_expert(torch.full((5, 2), 9, dtype=torch.int32), 0, 4, 16)  # nothing local
    assert int(g.num_rows.item()) == 0 and bool((g.block_expert == -1).all()) and bool((g.sorted_pairs == 10).all())


def test_grouping_many_programs_at_prefill_size():
    gen = torch.Generator().manual_seed(3)  # 2,600 tokens x 4 = 10,400 pairs: above PARALLEL_MIN_PAIRS
    _check_grouping(torch.randint(0, 32, (2600, 4), generator=gen, dtype=torch.int32), 0, 32, 128)


# ---- the whole layer ------------------------------------------------------------------------------
FUSED = MoEConfig(16, TileConfig(16, 256, 128, 1, 4, 2), TileConfig(16, 64, 128, 2, 4, 2))
UNFUSED = MoEConfig(32, TileConfig(32, 128, 128, 2, 4, 2), TileConfig(32, 128, 64, 1, 4, 2))
# Decode-style split-K: K ranges over CTAs, fp32 partials summed in split order by a fix-up launch
# (3 does not divide the K blocks evenly; 4 > K blocks at h = 256 leaves an empty split).
SPLIT3 = MoEConfig(16, TileConfig(16, 256, 128, 1, 4, 2, 3), TileConfig(16, 64, 128, 1, 4, 2, 3))
SPLIT4 = MoEConfig(16, TileConfig(16, 128, 128, 1, 4, 2, 4), TileConfig(16, 32, 64, 1, 4, 2, 4))
# Weight tiles by TMA descriptors (rows past N, columns past K zero-filled), whole K and split-K.
TMA = MoEConfig(16, TileConfig(16, 256, 128, 1, 4, 2, tma=True), TileConfig(16, 64, 128, 2, 4, 2, tma=True))
TMA_SPLIT3 = MoEConfig(16, TileConfig(16, 128, 128, 1, 4, 2, 3, tma=True),
                       TileConfig(16, 64, 128, 1, 4, 2, 3, tma=True))


@pytest.mark.parametrize("cfg", [FUSED, UNFUSED, SPLIT3, SPLIT4, TMA, TMA_SPLIT3],
                         ids=["fused_requant", "separate_requant", "split_k3", "split_k4", "tma", "tma_split_k3"])
@pytest.mark.parametrize("h,i", [(160, 128), (256, 96)])
def test_fp8_moe_fp32_tight(cfg: MoEConfig, h: int, i: int):
    # Own seed: with the data the global generator happened to give after other tests, an activation
    # on an e4m3 rounding boundary flipped a whole step (rel 5e-3), so the data must not depend on order.
    torch.manual_seed(1000 * h + i)
    t, e = 11, 8
    w = _experts(e, e, h, i, torch.float32, fp8=True)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32)
    out = TritonMoE(cfg)(x, logits, 4, w)
    # Typically ~3e-7; a re-quantised activation sitting on an e4m3 rounding boundary can flip one
    # step (the fp32 sums differ in order), which moves that token's row by ~1e-4.
    assert _rel(out, _fp8_act_reference(x, logits, 4, w)) < 1e-3
    # vs the bf16-style reference (weights dequantised, activations exact): FP8 activation error.
    assert _rel(out, TorchMoE()(x, logits, 4, w)) < 6e-2


def test_fp8_moe_bf16_hidden_2880():
    t, e, h, i = 5, 4, 2880, 128
    w = _experts(e, e, h, i, torch.bfloat16, fp8=True, seed=1)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    logits = _logits(t, e, torch.bfloat16, seed=1)
    out = TritonMoE()(x, logits, 2, w)
    assert out.dtype == torch.bfloat16
    # The interpreter's fp32->bf16 cast truncates (the GPU rounds to nearest) at four points here
    # (routing weight, y, y * weight, output): ~0.4% each, one-sided. fp32 tests above are tight.
    assert _rel(out, _fp8_act_reference(x, logits, 2, w)) < 2e-2


@pytest.mark.parametrize("cfg", [None, UNFUSED, SPLIT4], ids=["default", "bm32", "split_k4"])
def test_native_fp32_matches_torch_moe(cfg: MoEConfig | None):
    t, e, h, i = 9, 8, 160, 64
    w = _experts(e, e, h, i, torch.float32, fp8=False)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32)
    assert _rel(TritonMoE(cfg)(x, logits, 4, w), TorchMoE()(x, logits, 4, w)) < 1e-5


def test_native_bf16_close_to_fp32_math():
    t, e, h, i = 9, 8, 160, 64
    w = _experts(e, e, h, i, torch.bfloat16, fp8=False, seed=2)
    x = torch.randn(t, h, dtype=torch.bfloat16)
    logits = _logits(t, e, torch.bfloat16, seed=2)
    out = TritonMoE()(x, logits, 4, w)
    w32 = ExpertWeights(w.w1.float(), None, w.b1.float(), w.w2.float(), None, w.b2.float(), 0, e, 1.702, 7.0)
    vals, ids = torch.topk(logits, 4)
    weights = torch.softmax(vals, -1, dtype=vals.dtype).float()
    want = ref.moe(x.float(), weights, ids, w32.w1, w32.b1, w32.w2, w32.b2, 1.702, 7.0)
    # bf16 storage of act, y, y * weight and the output (truncated by the interpreter, ~0.4% each).
    assert out.dtype == torch.bfloat16 and _rel(out, want) < 2.5e-2
    assert _rel(out, TorchMoE()(x, logits, 4, w)) < 4e-2  # the reference rounds every op to bf16


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_parallel_ranks_sum_to_full(fp8: bool):
    """EP: each rank keeps only its experts' pairs; b2 lives with its expert; the sum of the ranks'
    partial outputs (the all-reduce) equals the single-rank layer."""
    t, e, h, i = 10, 8, 160, 128
    full = _experts(e, e, h, i, torch.float32, fp8=fp8, seed=3)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=3)
    moe = TritonMoE(FUSED)
    total = moe(x, logits, 4, full)
    parts = []
    for start in (0, 3, 6):  # uneven ranges: 3 + 3 + 2 experts
        stop = min(start + 3, e)
        sl = slice(start, stop)
        part = ExpertWeights(full.w1[sl], None if not fp8 else full.w1_scale[sl], full.b1[sl], full.w2[sl],
                             None if not fp8 else full.w2_scale[sl], full.b2[sl], start, e, 1.702, 7.0)
        out = moe(x, logits, 4, part)
        want = TorchMoE()(x, logits, 4, part) if not fp8 else None
        if want is not None:
            assert _rel(out, want) < 1e-5
        parts.append(out)
    assert _rel(sum(parts), total) < 1e-5


@pytest.mark.parametrize("fp8", [False, True])
def test_b2_none_and_skewed_routing(fp8: bool):
    """b2 None (a TP rank that must not add it); all tokens routed to the same experts, the rest
    without tokens; top-1."""
    t, e, h, i = 12, 8, 160, 128
    w = _experts(e, e, h, i, torch.float32, fp8=fp8, b2=False, seed=4)
    x = torch.randn(t, h)
    logits = _logits(t, e, torch.float32, seed=4)
    logits[:, 5] += 100.0  # expert 5 first for every token
    logits[:, 2] += 50.0
    for k in (1, 4):
        out = TritonMoE()(x, logits, k, w)
        want = _fp8_act_reference(x, logits, k, w) if fp8 else TorchMoE()(x, logits, k, w)
        assert _rel(out, want) < (1e-3 if fp8 else 1e-5)


def test_zero_tokens_and_registry():
    w = _experts(8, 8, 160, 64, torch.float32, fp8=False)
    out = TritonMoE()(torch.empty(0, 160), torch.empty(0, 8), 4, w)
    assert out.shape == (0, 160)
    assert isinstance(make_moe("triton"), TritonMoE)


# ---- tuning tables --------------------------------------------------------------------------------
def test_tuning_tables_and_defaults():
    table = load_table("moe.json")
    for key in ("fp8_N5760_K2880", "bf16_N5760_K2880"):
        assert key in table, f"moe.json lacks {key}"
        for m, entry in table[key].items():
            cfg = MoEConfig.from_json(entry)
            assert MoEConfig.from_json(cfg.to_json()) == cfg
            if key.startswith("fp8"):
                assert cfg.gemm1.block_k == 128 and cfg.gemm2.block_k in (64, 128)
    assert moe_config(1, 5760, 2880, True).block_m <= moe_config(4096, 5760, 2880, True).block_m
    for m in (1, 40, 200, 5000):
        for fp8 in (True, False):
            cfg = default_moe_config(m, fp8)
            assert (cfg.gemm1.block_n == 256) == fp8  # FP8 default fuses the re-quantisation
    assert "N5120_K2880" in load_table("fp8_gemm.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert moe_config(7, 96, 40, True) == default_moe_config(7, True)  # unknown dims: defaults
