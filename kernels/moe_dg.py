"""Prefill MoE on DeepGEMM's M-grouped FP8 GEMM (thousands of tokens, compute-bound).

The Triton grouped MoE (kernels/moe.py) fuses gather, bias and SwiGLU into its GEMMs but its main
loop reaches ~44 % of the H200's FP8 peak at 8k tokens; DeepGEMM's warp-specialised kernel runs the
same grouped GEMMs at ~1,000+ TFLOP/s (run DG1) but has fixed prologue/epilogue. So the work is
split into GEMMs plus three light memory passes, all on device, no host sync (graph-capturable):

  1. route + group   as kernels/moe.py (top-k softmax, rows grouped by local expert, 128-aligned)
  2. gather          xq [T, H] e4m3 (quantised once per token) -> a [R, H] in grouped row order,
                     its scales [R, H/128] M-major, layout [R] (expert of each row, -1 = unused
                     tile) and row_of_pair [P]
  3. gate_up GEMM    h = a W1[e]^T  [R, 2I] bf16                          (DeepGEMM, grouped)
  4. SwiGLU          act = SwiGLU(h + b1[e]) re-quantised 1x128 -> e4m3 [R, I] + scales
  5. down GEMM       y = act W2[e]^T [R, H] bf16                           (DeepGEMM, grouped)
  6. combine         out[t] = sum_j w[t, j] * round(y[row(t, j)] + b2[e])  in fp32, slot order

Rounding differs from the fused path in one place: h and y leave the GEMM as bf16 before their
biases are added (the fused kernels add them to the fp32 accumulator); both are within the FP8
tolerance of the reference (GPU test). On CPU the grouped GEMM runs as a dequantised torch matmul
(`reference_grouped_gemm`), so the Triton passes are tested under TRITON_INTERPRET.
Shapes: T tokens, H hidden, I intermediate, E_l local experts, P = T*k pairs, R = row capacity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import deepgemm_sm90 as dg
from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128, quantize_tile
from kernels.interface import ExpertWeights
from kernels.moe_align import ExpertGrouping, align_by_expert, route_topk_softmax
from kernels.reference import BLOCK, FP8_MAX

BLOCK_M = 128  # DeepGEMM's row tile = the grouping's padding unit
GATE_UP = dg.DgConfig(128, 160, mcast=2, gemm_type=dg.GROUPED)  # 20b, 8k tokens: 1,016 TFLOP/s (DG1)
DOWN = dg.DgConfig(128, 160, mcast=2, gemm_type=dg.GROUPED)
# Below this many routed rows per expert (T * k / E) the Triton MoE wins: run DG2 measured
# 64 rows/expert about even (20b T=512: 430 vs 443 us; 120b T=2048: 1,679 vs 1,617 us), 128 and up
# DeepGEMM ahead (20b T=1024: 539 vs 623 us; 120b T=8192: 3.03 vs 3.90 ms).
MIN_ROWS_PER_EXPERT = 96
# Rows per program of the SwiGLU pass and its warps (launch settings only; run DG11 at 8k tokens:
# 16 x 4 223.8 us, 32 x 8 237.8, 64 x 8 316, same bits)
SWIGLU_ROWS = 16  # divides BLOCK_M (SWIGLU_TILE_EXPERT relies on it)
SWIGLU_WARPS = 4
# The SwiGLU pass reading each program's expert and b1 row once (its rows lie in one 128-row tile, so
# they share them) instead of per row, and skipping unused tiles (no consumer reads their act): half
# the bytes it pulls into the SM, the same bits for every used row. prefill-reads-ab-1 (H100, 8k tokens,
# benchmarks/fusion.py): 16 x 4 per row 237.6 us, per tile 209.6 (2.4 TB/s).
SWIGLU_TILE_EXPERT = True


@triton.jit
def _gather_kernel(xq_ptr, xs_ptr, sorted_ptr, block_expert_ptr, a_ptr, as_ptr, layout_ptr, row_of_pair_ptr,
                   P, K, stride_xq, stride_xs_m, stride_xs_k, stride_a, stride_as,
                   TOP_K: tl.constexpr, BLOCK_M_: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, KB: tl.constexpr, BLOCK_KB: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS] grouped rows
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    # The tile's expert for every row of it (DeepGEMM reads the B offset and validity per tile).
    tl.store(layout_ptr + rows, tl.load(block_expert_ptr + rows // BLOCK_M_))
    tl.store(row_of_pair_ptr + pair, rows, mask=valid)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        q = tl.load(xq_ptr + tok[:, None] * stride_xq + cols[None, :], mask=valid[:, None] & cm[None, :], other=0.0)
        tl.store(a_ptr + rows[:, None].to(tl.int64) * stride_a + cols[None, :], q, mask=cm[None, :])
    kb = tl.arange(0, BLOCK_KB)
    km = kb < KB
    s = tl.load(xs_ptr + tok[:, None] * stride_xs_m + kb[None, :] * stride_xs_k, mask=valid[:, None] & km[None, :],
                other=0.0)
    tl.store(as_ptr + kb[None, :] * stride_as + rows[:, None], s, mask=km[None, :])


@triton.jit
def _swiglu_quant_kernel(h_ptr, b1_ptr, layout_ptr, act_ptr, acts_ptr, I, alpha, limit,
                         stride_h, stride_b1, stride_act, stride_acts,
                         ROWS: tl.constexpr, GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr,
                         TILE_EXPERT: tl.constexpr = False):
    """TILE_EXPERT: the program's ROWS rows lie in one BLOCK_M tile (ROWS divides BLOCK_M), so one
    layout entry and one b1 row serve them all, and an unused tile is skipped (DeepGEMM never reads
    its rows); used rows get the same bits either way."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cb = tl.program_id(1)
    offs_i = cb * GROUP + tl.arange(0, GROUP)  # act columns
    im = offs_i < I
    # W1's rows interleave gate (2i) and up (2i+1): one contiguous [ROWS, 2G] load, split in
    # registers (stride-2 loads ran at ~1 TB/s in run DG3).
    cols2 = cb * 2 * GROUP + tl.arange(0, 2 * GROUP)
    if TILE_EXPERT:
        e0 = tl.load(layout_ptr + tl.program_id(0) * ROWS)
        if e0 < 0:
            return
        used = rows >= 0  # every row of a used tile
        m2 = (cols2 < 2 * I)[None, :] & used[:, None]
        hv = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols2[None, :], mask=m2, other=0.0).to(tl.float32)
        hv += tl.load(b1_ptr + e0.to(tl.int64) * stride_b1 + cols2, mask=cols2 < 2 * I, other=0.0).to(tl.float32)[None, :]
    else:
        e = tl.load(layout_ptr + rows)
        used = e >= 0
        e = tl.maximum(e, 0).to(tl.int64)
        m2 = used[:, None] & (cols2 < 2 * I)[None, :]
        hv = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols2[None, :], mask=m2, other=0.0).to(tl.float32)
        hv += tl.load(b1_ptr + e[:, None] * stride_b1 + cols2[None, :], mask=m2, other=0.0).to(tl.float32)
    gate, up = tl.split(tl.reshape(hv, (ROWS, GROUP, 2)))  # [ROWS, G] each
    m = used[:, None] & im[None, :]
    gate = tl.minimum(gate, limit)  # from above only
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    act = tl.where(m, act, 0.0)
    q, scale = quantize_tile(act, im[None, :], FP8_MAX_C, HW_CVT)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + offs_i[None, :], q.to(act_ptr.dtype.element_ty),
             mask=im[None, :])
    tl.store(acts_ptr + cb * stride_acts + rows, scale)


@triton.jit
def _combine_kernel(y_ptr, b2_ptr, w_ptr, ids_ptr, row_of_pair_ptr, out_ptr, H, expert_start, num_local,
                    stride_y, stride_b2, stride_out, TOP_K: tl.constexpr, HAS_B2: tl.constexpr,
                    ROUND_Y: tl.constexpr, ROUND_PRODUCT: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slot order: deterministic, like the reference's sum
        e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
        if (e >= 0) & (e < num_local):  # slots routed to another rank's experts add nothing here
            r = tl.load(row_of_pair_ptr + t * TOP_K + j).to(tl.int64)
            y = tl.load(y_ptr + r * stride_y + offs, mask=hm).to(tl.float32)
            if HAS_B2:
                y += tl.load(b2_ptr + e * stride_b2 + offs, mask=hm).to(tl.float32)
            # The reference's rounding points: the linear's output in x.dtype, then the product with
            # the routing weight in their promoted dtype.
            if ROUND_Y:
                y = y.to(tl.bfloat16).to(tl.float32)
            y = y * tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
            if ROUND_PRODUCT:
                y = y.to(tl.bfloat16).to(tl.float32)
            acc += y
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hm)


def reference_grouped_gemm(a: torch.Tensor, sfa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                           out: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """What DeepGEMM's grouped kernel computes, in torch (CPU tests; slow): out[r] = deq(a[r]) .
    deq(W[layout[r]])^T for rows of used tiles, in fp32, stored as bf16."""
    from kernels import reference as ref  # noqa: PLC0415
    ad = ref.dequantize_fp8_per_token(a, sfa)
    for e in layout.unique().tolist():
        if e < 0:
            continue
        r = (layout == e).nonzero().squeeze(1)
        wd = ref.dequantize_fp8_blockwise(w[e], ws[e])
        out[r] = (ad[r].float() @ wd.float().t()).to(out.dtype)
    return out


class DeepGemmMoE:
    """MoEImpl: prefill-sized FP8 batches on DeepGEMM (see the module docstring); batches with
    fewer than `min_rows_per_expert` routed rows per expert, and native weights, go to the Triton
    MoE, which wins there (128-row tiles waste most of their rows)."""

    name = "deepgemm"

    def __init__(self, gate_up_cfg: dg.DgConfig = GATE_UP, down_cfg: dg.DgConfig = DOWN,
                 min_rows_per_expert: float = MIN_ROWS_PER_EXPERT) -> None:
        from kernels.moe import TritonMoE  # noqa: PLC0415

        self.gate_up_cfg, self.down_cfg = gate_up_cfg, down_cfg
        self.min_rows_per_expert = min_rows_per_expert
        self.fallback = TritonMoE()

    def prepare(self, device: torch.device) -> None:
        """Builds/loads the launchers now, so a missing toolchain fails at start-up, not mid-request."""
        dg.prepare([self.gate_up_cfg, self.down_cfg], device)

    def _gemm(self, cfg: dg.DgConfig, a, sfa, w, ws, out, layout) -> torch.Tensor:
        if not a.is_cuda:
            return reference_grouped_gemm(a, sfa, w, ws, out, layout)
        return dg.gemm(cfg, a, sfa, w.view(-1, w.shape[-1]), ws, out, layout)

    def _grouped(self, num_tokens: int, top_k: int, w: ExpertWeights) -> bool:
        return num_tokens * top_k >= self.min_rows_per_expert * w.num_experts and w.w1_scale is not None

    def takes_fp8_input(self, num_tokens: int, top_k: int, w: ExpertWeights) -> bool:
        return (num_tokens > 0 and self._grouped(num_tokens, top_k, w)) or self.fallback.takes_fp8_input(
            num_tokens, top_k, w)

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        t, hdim = x.shape
        if t == 0:
            return torch.zeros_like(x)
        if not self._grouped(t, top_k, w):
            return self.fallback(x, router_logits, top_k, w, x_fp8)
        dev = x.device
        weights, ids = route_topk_softmax(router_logits, top_k)  # [T, k] each
        g: ExpertGrouping = align_by_expert(ids, w.expert_start, w.num_local, BLOCK_M)
        rows = g.sorted_pairs.shape[0]
        xq, xs = x_fp8 if x_fp8 is not None else quantize_act_1x128(x)  # once per token (or by the norm)
        kb = xs.shape[1]
        a = torch.empty(rows, hdim, dtype=FP8_DTYPE, device=dev)
        as_buf = torch.empty(kb, rows, dtype=torch.float32, device=dev)  # M-major, rows % 128 == 0
        layout = torch.empty(rows, dtype=torch.int32, device=dev)
        row_of_pair = torch.empty(g.num_pairs + 1, dtype=torch.int32, device=dev)  # +1: padding's slot
        gr = 16  # rows per program (R is a multiple of 128)
        _gather_kernel[(rows // gr,)](xq, xs, g.sorted_pairs, g.block_expert, a, as_buf, layout, row_of_pair,
                                      g.num_pairs, hdim, xq.stride(0), xs.stride(0), xs.stride(1), a.stride(0),
                                      as_buf.stride(0), TOP_K=top_k, BLOCK_M_=BLOCK_M, ROWS=gr, BLOCK_K=512,
                                      KB=kb, BLOCK_KB=triton.next_power_of_2(kb), num_warps=4)
        n1 = w.w1.shape[1]
        inter = n1 // 2
        h = torch.empty(rows, n1, dtype=torch.bfloat16, device=dev)
        self._gemm(self.gate_up_cfg, a, as_buf.t(), w.w1, w.w1_scale, h, layout)
        kb2 = -(-inter // BLOCK)
        act = torch.empty(rows, inter, dtype=FP8_DTYPE, device=dev)
        acts_buf = torch.empty(kb2, rows, dtype=torch.float32, device=dev)
        _swiglu_quant_kernel[(rows // SWIGLU_ROWS, kb2)](h, w.b1, layout, act, acts_buf, inter, float(w.alpha),
                                               float(w.limit), h.stride(0), w.b1.stride(0), act.stride(0),
                                               acts_buf.stride(0), ROWS=SWIGLU_ROWS, GROUP=BLOCK,
                                               FP8_MAX_C=FP8_MAX, HW_CVT=x.is_cuda, TILE_EXPERT=SWIGLU_TILE_EXPERT,
                                               num_warps=SWIGLU_WARPS)
        y = torch.empty(rows, hdim, dtype=torch.bfloat16, device=dev)
        self._gemm(self.down_cfg, act, acts_buf.t(), w.w2, w.w2_scale, y, layout)
        out = torch.empty(t, hdim, dtype=x.dtype, device=dev)
        b2 = w.b2 if w.b2 is not None else y
        block_h = 1024
        _combine_kernel[(t, triton.cdiv(hdim, block_h))](
            y, b2, weights, ids, row_of_pair, out, hdim, w.expert_start, w.num_local, y.stride(0),
            b2.stride(0), out.stride(0), TOP_K=top_k, HAS_B2=w.b2 is not None,
            ROUND_Y=x.dtype == torch.bfloat16,
            ROUND_PRODUCT=torch.promote_types(x.dtype, weights.dtype) == torch.bfloat16, BLOCK_H=block_h,
            num_warps=4)
        return out
