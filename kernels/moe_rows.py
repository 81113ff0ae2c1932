"""The FP8 MoE layer for one token on the CUDA cores (W8A16): two launches, whole weight rows per program,
x and the SwiGLU activation kept in bf16 (`Fusion.MOE_ROWS`).

At batch 1 the layer reads 4 experts' rows (66 MB gate_up + 33 MB down for gpt-oss) and computes almost
nothing; the MMA path (kernels/moe_small.py) needs x and the activation in e4m3 1x128 groups and split-K
partials summed by a last CTA, and measured 0.61 of the copy rate on the H200 (issue27-h200-1), of which
~5-6 us a layer were its chain (b1-probes-2: x quantisation, the split-K fix-up, SwiGLU and act
re-quantisation in the last CTA). Here nothing is quantised and nothing is split:

  1. gate_up   one program per (pair, BLOCK_N rows of W1). It routes its token (the grouped path's top-k +
               softmax; the program of slot 0, tile 0 stores ids and weights for launch 2), reads expert
               ids[p]'s rows against x (kernels/fp8_rows.rows_dot: the block scale folded into x), adds b1,
               rounds to x's dtype (the reference's rounding of the linear), and runs the clamped SwiGLU on its
               interleaved gate/up rows: act [P, I] in x's dtype.
  2. down      one program per (token, BLOCK_N rows of W2) reading the rows of ALL top_k experts in one
               tile ([TOP_K * BLOCK_N, 128]: four times the bytes in flight of one slot), each row against
               its slot's act row; then per slot + b2, rounded to x's dtype, times the routing weight, rounded
               again (the grouped path's rounding points) and summed over the slots in slot order in fp32.

Slots whose expert another EP rank owns read nothing (masked rows) and add nothing. Deterministic (no
atomics), CUDA-graph safe (no scratch beyond two small outputs, no host sync). Against the W8A8 kernels the
bits differ (x and act are not quantised): closer to the bf16 model, measured by the parity tests against
reference.moe on the dequantised weights.
Shapes: T tokens, H hidden, E experts (El local), I intermediate per rank, P = T * top_k pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels.fp8_rows import FP8, INTERPRETED, pdl_launch, rows_dot
from kernels.interface import ExpertWeights
from kernels.moe import _ROUND_CODE, round_as
from kernels.moe_align import store_routes, topk_softmax_rows
from kernels.reference import BLOCK

__all__ = ["INTERPRETED", "MoERowsConfig", "moe_rows"]


@triton.jit
def _gate_up_rows_kernel(logits_ptr, rw_ptr, ids_ptr, x_ptr, w_ptr, ws_ptr, b_ptr, act_ptr, N, K, I, E,
                         expert_start, num_local, alpha, limit, stride_lt, stride_xt, stride_we, stride_wn,
                         stride_wse, stride_wsn, stride_wsk, stride_be, stride_ap, TOP_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
                         H_ROUND: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early: the router's logits and x are the kernel ahead's output
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    nt = pid % num_n
    p = pid // num_n
    t = p // TOP_K
    j = p % TOP_K
    rows = t + tl.arange(0, 1)  # [1]
    ids, wts = topk_softmax_rows(logits_ptr, rows, rows >= 0, E, stride_lt, TOP_K, BLOCK_E, BLOCK_TK)
    writer = ((j == 0) & (nt == 0)).to(tl.int32)
    store_routes(ids_ptr, rw_ptr, rows, ids, wts, (rows * 0 + writer) > 0, TOP_K, BLOCK_TK)
    e = tl.sum(tl.sum(tl.where((tl.arange(0, BLOCK_TK) == j)[None, :], ids, 0), axis=1), axis=0) - expert_start
    if (e >= 0) & (e < num_local):  # else another EP rank's expert: no act row, launch 2 skips the slot
        e64 = e.to(tl.int64)
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        v = rows_dot(x_ptr + t * stride_xt, w_ptr + e64 * stride_we,
                     ws_ptr + e64 * stride_wse + ((nt * BLOCK_N) // 128) * stride_wsn, offs_n, nmask, K, stride_wn,
                     stride_wsk, BLOCK_N, UNROLL)  # [BN]
        v = round_as(v + tl.load(b_ptr + e64 * stride_be + offs_n, mask=nmask, other=0.0).to(tl.float32), H_ROUND)
        # Clamped SwiGLU on interleaved rows: 2i = gate_i, 2i+1 = up_i (model quirk of gpt-oss: the gate is
        # clamped from above only, and up enters as up + 1).
        gate, up = tl.split(tl.reshape(v, (BLOCK_N // 2, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)  # [BN/2]
        offs_i = nt * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(act_ptr + p * stride_ap + offs_i, act.to(act_ptr.dtype.element_ty), mask=offs_i < I)


@triton.jit
def _down_rows_kernel(act_ptr, ids_ptr, rw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, N, K, expert_start, num_local,
                      stride_ap, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_be, stride_ot,
                      TOP_K: tl.constexpr, BLOCK_TK: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_ROUND: tl.constexpr,
                      Y_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:
        gdc_wait()  # ids, weights and act are gate_up's output
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    nt = pid % num_n
    t = pid // num_n
    # One tile row per (slot, output row): r = slot * BLOCK_N + i.
    r = tl.arange(0, BLOCK_TK * BLOCK_N)  # [R]
    slot = r // BLOCK_N
    offs_n = nt * BLOCK_N + r % BLOCK_N  # [R]
    e = tl.load(ids_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0) - expert_start  # [R]
    live = (slot < TOP_K) & (e >= 0) & (e < num_local) & (offs_n < N)  # another rank's slot reads nothing
    e64 = tl.where(live, e, 0).to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + offs_n.to(tl.int64) * stride_wn  # [R] row starts
    s_rows = ws_ptr + e64 * stride_wse + ((nt * BLOCK_N) // 128) * stride_wsn  # [R] scale rows
    a_rows = act_ptr + (t * TOP_K + tl.where(slot < TOP_K, slot, 0)).to(tl.int64) * stride_ap  # [R] act rows
    offs_k = tl.arange(0, BLOCK_K)  # one 128-column scale group per K step: a row's scale is one value there
    acc = tl.zeros((BLOCK_TK * BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):  # loads in flight: kernels/fp8_rows.rows_dot
        kk = k0 + offs_k
        m = live[:, None] & (kk < K)[None, :]  # [R, BK]
        w = tl.load(w_rows[:, None] + kk[None, :], mask=m, other=0.0, eviction_policy="evict_first")
        a = tl.load(a_rows[:, None] + kk[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.load(s_rows + (k0 // BLOCK_K) * stride_wsk, mask=live, other=0.0)  # [R]
        acc += w.to(tl.float32) * (a * s[:, None])
    v = tl.sum(acc, axis=1)  # [R]
    if HAS_BIAS:  # b2 (one EP rank, or TP rank 0, holds it), inside the routing weight
        v += tl.load(b_ptr + e64 * stride_be + offs_n, mask=live, other=0.0).to(tl.float32)
    rw = tl.load(rw_ptr + t * TOP_K + slot, mask=slot < TOP_K, other=0.0).to(tl.float32)
    # Reference rounding points: the linear's output in x.dtype, times the weight, in y's dtype.
    y = tl.where(live, round_as(round_as(v, OUT_ROUND) * rw, Y_ROUND), 0.0)
    y2 = tl.reshape(y, (BLOCK_TK, BLOCK_N))
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(TOP_K):  # slots in order, like the grouped path's combine
        out += tl.sum(tl.where((tl.arange(0, BLOCK_TK) == jj)[:, None], y2, 0.0), axis=0)
    offs_o = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + t * stride_ot + offs_o, out.to(out_ptr.dtype.element_ty), mask=offs_o < N)


@dataclass(frozen=True, slots=True)
class MoERowsConfig:
    block_n1: int = 16  # W1 rows per gate_up program (even: gate/up pairs; divides 128)
    unroll1: int = 8  # 128-column K steps per loop trip
    warps1: int = 4
    block_n2: int = 8  # W2 rows per down program, for each of the top_k slots (divides 128)
    unroll2: int = 4  # [top_k * block_n2, 128] tiles (4 KB of FP8 at top_k 4) per K step, this many per loop trip
    warps2: int = 8
    pdl: bool = True


DEFAULT_CONFIG = MoERowsConfig()


def moe_rows(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
             cfg: MoERowsConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [T, H] (a few tokens; each re-reads its experts' rows), router_logits [T, E] -> this rank's share of
    the MoE output [T, H] in x's dtype: MoEImpl's contract, for FP8 experts."""
    assert w.w1_scale is not None and w.w2_scale is not None and w.w1.dtype == FP8, "the rows path is FP8 only"
    assert BLOCK % cfg.block_n1 == 0 and cfg.block_n1 % 2 == 0 and BLOCK % cfg.block_n2 == 0
    t, h = x.shape
    e = router_logits.shape[1]
    n1, k1 = w.w1.shape[1], w.w1.shape[2]  # 2I, H
    n2, k2 = w.w2.shape[1], w.w2.shape[2]  # H, I
    assert k1 == h and n2 == h and k2 * 2 == n1, (x.shape, w.w1.shape, w.w2.shape)
    x = x if x.stride(1) == 1 else x.contiguous()
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    dev, hw, p = x.device, x.is_cuda, t * top_k
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=dev)  # [T, top_k]
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)  # [T, top_k]
    act = torch.empty(p, k2, dtype=x.dtype, device=dev)  # [P, I]
    out = torch.empty(t, n2, dtype=x.dtype, device=dev)  # [T, H]
    if t == 0:
        return out
    block_tk = triton.next_power_of_2(top_k)
    _gate_up_rows_kernel[(p * triton.cdiv(n1, cfg.block_n1),)](
        logits, weights, ids, x, w.w1, w.w1_scale, w.b1, act, n1, k1, k2, e, w.expert_start, w.num_local,
        float(w.alpha), float(w.limit), logits.stride(0), x.stride(0), w.w1.stride(0), w.w1.stride(1),
        w.w1_scale.stride(0), w.w1_scale.stride(1), w.w1_scale.stride(2), w.b1.stride(0), act.stride(0),
        TOP_K=top_k, BLOCK_E=triton.next_power_of_2(e), BLOCK_TK=block_tk, BLOCK_N=cfg.block_n1,
        UNROLL=cfg.unroll1, H_ROUND=_ROUND_CODE[x.dtype], num_warps=cfg.warps1, **pdl_launch(cfg.pdl, hw))
    b2 = w.b2 if w.b2 is not None else w.b1  # unused pointer without bias
    _down_rows_kernel[(t * triton.cdiv(n2, cfg.block_n2),)](
        act, ids, weights, w.w2, w.w2_scale, b2, out, n2, k2, w.expert_start, w.num_local, act.stride(0),
        w.w2.stride(0), w.w2.stride(1), w.w2_scale.stride(0), w.w2_scale.stride(1), w.w2_scale.stride(2),
        b2.stride(0), out.stride(0), TOP_K=top_k, BLOCK_TK=block_tk, HAS_BIAS=w.b2 is not None,
        OUT_ROUND=_ROUND_CODE[x.dtype], Y_ROUND=_ROUND_CODE[torch.promote_types(x.dtype, weights.dtype)],
        BLOCK_N=cfg.block_n2, BLOCK_K=BLOCK, UNROLL=cfg.unroll2, num_warps=cfg.warps2, **pdl_launch(cfg.pdl, hw))
    return out
