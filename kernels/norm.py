"""Fused RMSNorm in Triton: one kernel per norm instead of the ~6 elementwise/reduction kernels of
the torch expression, which at batch-1 decode cost ~1 us each (profile_decode_b1.txt), with what
sits next to a norm folded into the same launch:

  * the residual add: x = x + delta (the attention or MoE output), the sum rounded to the
    activation dtype first, as `x = x + y` is in the reference; the new residual is written too;
  * the MoE router (`router`): logits = y W_r^T + b_r for a few tokens. At batch-1 decode cuBLAS
    spends ~4.3 us + a 1.8 us split-K reduce per layer on this 32 x 2880 GEMV (profile_decode_b1.txt):
    here the grid gets one extra dimension of programs, each re-derives the row's norm (the row is
    in L2) and computes `ROUTER_EXPERTS_PER_PROGRAM` logits; program 0 of the row writes x and y;
  * the MoE's FP8 input (`quant`): y quantised to e4m3 in 1x128 groups, the bits and layout of
    `kernels.fp8_quant.quantize_act_1x128(y)` (scales [T, ceil(H/128)] with strides (1, T)), so an FP8
    MoE that would quantise its input first (DeepGEMM's, the grouped Triton one, the few-token one) reads
    these. For a few tokens the groups are spread over the row's programs (`QUANT_SPREAD_MAX_TOKENS`): one program
    quantising a whole row ran ~2 us longer than norm + a separate quantisation launch at one token
    (fusion-ab-1, H200: 5.2 vs 3.1 us), a chain of ~32 divisions per thread with one warp per scheduler;
    spread, 2.44 us (norm-quant-b1-ab-1). Each program re-derives y for its groups from the row's rsqrt
    (the same bits as the stored y).

Same math as kernels.reference.rms_norm: fp32 statistics, fp32 weight, y cast to the activation
dtype. Every variant runs the same row code (`_norm_row`) with the same launch shape per row; on the
H200 the router variant's y can still differ from the plain norm's in the last bit (the compiler may
pick another layout for the row, so x^2 sums in another order; tests/kernels/test_fusion_gpu.py).
Router logits: an fp32 dot of the rounded y and W_r plus b_r, rounded once to the logits dtype
(cuBLAS's rounding points; its summation order differs, so logits can differ from F.linear's in the
last bit).
Rows are [T, H] with any row stride; columns are laid out as [NG, 128] groups (NG = the next power
of two of ceil(H/128)), which is what the 1x128 quantisation needs and costs nothing elsewhere.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import FP8_DTYPE, quantize_tile
from kernels.reference import BLOCK, FP8_MAX

ROUTER_EXPERTS_PER_PROGRAM = 4  # 20b: 8 programs per token, 120b: 32; each reads 4 x H x 2 bytes of W_r
NUM_WARPS = 4  # per row program (benchmarks/fusion.py sweeps it)
# Up to this many tokens `quant` spreads a row's 1x128 groups over QUANT_PROGRAMS programs (or the router's, if
# more): a few rows leave most SMs idle, so the quantisation's latency is the launch's. norm-quant-b1-ab-1 (H200):
# norm + quant at 1 token 2.44 us spread vs 5.06 in one program (3.14 as two launches), at 64 tokens 3.25 vs 5.69;
# from 65 tokens on, rows fill the GPU and one program quantises its row.
QUANT_SPREAD_MAX_TOKENS = 64
QUANT_PROGRAMS = 8


class NormOut(NamedTuple):
    x: torch.Tensor  # [T, H] the residual stream (x + delta; x itself without delta)
    y: torch.Tensor  # [T, H] rms_norm(x) in x.dtype
    yq: torch.Tensor | None = None  # [T, H] e4m3 (quant)
    ys: torch.Tensor | None = None  # [T, ceil(H/128)] fp32, strides (1, T) (quant)
    logits: torch.Tensor | None = None  # [T, E] in x.dtype (router)


@triton.jit
def _norm_row(x_ptr, d_ptr, w_ptr, row, H, eps, stride_x, stride_d, HAS_DELTA: tl.constexpr, NG: tl.constexpr,
              G: tl.constexpr):
    """Row `row`: (columns [NG, G], their mask, x (+ delta) in the activation dtype, y fp32)."""
    cols = tl.arange(0, NG)[:, None] * G + tl.arange(0, G)[None, :]  # [NG, G]
    mask = cols < H
    r64 = row.to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # issued before the reduction needs it
    if HAS_DELTA:
        d = tl.load(d_ptr + r64 * stride_d + cols, mask=mask, other=0.0)
        x = (x + d).to(x_ptr.dtype.element_ty)  # the residual stream lives in the activation dtype
    xf = x.to(tl.float32)
    var = tl.sum(tl.sum(xf * xf, axis=1), axis=0) / H
    rstd = tl.rsqrt(var + eps)
    y = w * (xf * rstd)
    return cols, mask, x, y, rstd


@triton.jit
def _quant_groups(x_ptr, d_ptr, w_ptr, q_ptr, s_ptr, row, g0, rstd, H, stride_x, stride_d, stride_q, stride_sk,
                  HAS_DELTA: tl.constexpr, GP: tl.constexpr, G: tl.constexpr, FP8_MAX_C: tl.constexpr,
                  HW_CVT: tl.constexpr, y_dtype: tl.constexpr):
    """Groups [g0, g0 + GP) of row `row`: y re-derived from x (+ delta) and the row's rstd with _norm_row's
    per-element ops (so the same bits as the y it stores), then quantize_act_1x128's e4m3 and scales. Own loads,
    even where one program takes the whole row, so the row's own tensors are the plain norm's: quantising them
    gave a y other than the plain norm's in the last bit at 300 tokens (H200, norm-quant-b1-ab-1; read as the
    e4m3 store's layout reaching the x^2 sum). This form keeps them (norm-quant-default-check-1, H100: the fused-norm
    GPU tests at real widths pass)."""
    g = g0 + tl.arange(0, GP)  # [GP]
    cols = g[:, None] * G + tl.arange(0, G)[None, :]  # [GP, G]
    mask = cols < H
    r64 = row.to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0)  # in L2: the row was just read
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        x = (x + tl.load(d_ptr + r64 * stride_d + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    yb = (w * (x.to(tl.float32) * rstd)).to(y_dtype)
    q, scale = quantize_tile(tl.where(mask, yb.to(tl.float32), 0.0), mask, FP8_MAX_C, HW_CVT)
    tl.store(q_ptr + r64 * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + g * stride_sk + row, scale, mask=g * G < H)


@triton.jit
def _norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, q_ptr, s_ptr, rw_ptr, rb_ptr, l_ptr, H, E, eps,
                 stride_x, stride_d, stride_xo, stride_y, stride_q, stride_sk, stride_rw, stride_l,
                 HAS_DELTA: tl.constexpr, QUANT_OUT: tl.constexpr, ROUTER: tl.constexpr, HAS_RB: tl.constexpr,
                 NG: tl.constexpr, G: tl.constexpr, EPP: tl.constexpr, FP8_MAX_C: tl.constexpr,
                 HW_CVT: tl.constexpr, QUANT_GP: tl.constexpr):
    """Grid (T, programs per row): program (t, 0) writes row t's outputs; with ROUTER program (t, j)
    also writes logits [t, j*EPP : (j+1)*EPP]; with QUANT_OUT program (t, j) quantises groups
    [j*QUANT_GP, (j+1)*QUANT_GP) of y, from its own loads (see _quant_groups)."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols, mask, x, y, rstd = _norm_row(x_ptr, d_ptr, w_ptr, row, H, eps, stride_x, stride_d, HAS_DELTA, NG, G)
    r64 = row.to(tl.int64)
    yb = y.to(y_ptr.dtype.element_ty)
    if part == 0:
        if HAS_DELTA:
            tl.store(xo_ptr + r64 * stride_xo + cols, x, mask=mask)
        tl.store(y_ptr + r64 * stride_y + cols, yb, mask=mask)
    if QUANT_OUT:
        if part * QUANT_GP * G < H:
            _quant_groups(x_ptr, d_ptr, w_ptr, q_ptr, s_ptr, row, part * QUANT_GP, rstd, H, stride_x, stride_d,
                          stride_q, stride_sk, HAS_DELTA, QUANT_GP, G, FP8_MAX_C, HW_CVT, y_ptr.dtype.element_ty)
    if ROUTER and part * EPP < E:  # programs past the router's (quantising only) skip it
        yf = yb.to(tl.float32)  # the rounded y, as the unfused router reads it
        for j in tl.static_range(EPP):  # unrolled: the EPP weight-row loads are in flight together
            e = part * EPP + j
            wmask = cols < tl.where(e < E, H, 0)  # no columns for experts past E
            wr = tl.load(rw_ptr + e.to(tl.int64) * stride_rw + cols, mask=wmask, other=0.0)
            acc = tl.sum(tl.sum(wr.to(tl.float32) * yf, axis=1), axis=0)
            if HAS_RB:
                acc += tl.load(rb_ptr + e, mask=e < E, other=0.0).to(tl.float32)
            tl.store(l_ptr + r64 * stride_l + e, acc.to(l_ptr.dtype.element_ty), mask=e < E)


def fused_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
               quant: bool = False, router: tuple[torch.Tensor, torch.Tensor | None] | None = None,
               num_warps: int | None = None) -> NormOut:
    """x, delta [T, H] (delta None: no residual add) -> NormOut. quant: also y in e4m3 1x128 groups;
    router = (W_r [E, H], b_r [E] or None): also the router logits [T, E] in x.dtype."""
    t, h = x.shape
    assert x.stride(1) == 1 and (delta is None or (delta.shape == x.shape and delta.stride(1) == 1))
    xo = torch.empty_like(x) if delta is not None else x
    y = torch.empty_like(x)
    kb = -(-h // BLOCK)
    yq = torch.empty(t, h, dtype=FP8_DTYPE, device=x.device) if quant else None
    s_buf = torch.empty(kb, t, dtype=torch.float32, device=x.device) if quant else None
    logits = None
    parts = 1
    if router is not None:
        rw, rb = router
        assert rw.shape[1] == h and rw.stride(1) == 1 and (rb is None or rb.shape == (rw.shape[0],))
        logits = torch.empty(t, rw.shape[0], dtype=x.dtype, device=x.device)
        parts = triton.cdiv(rw.shape[0], ROUTER_EXPERTS_PER_PROGRAM)
    quant_gp = triton.next_power_of_2(kb)  # groups per program: one program per row takes them all
    if quant and t <= QUANT_SPREAD_MAX_TOKENS:
        parts = max(parts, min(QUANT_PROGRAMS, kb))
        quant_gp = triton.next_power_of_2(triton.cdiv(kb, parts))
        parts = triton.cdiv(kb, quant_gp) if router is None else parts  # no program without groups or logits
    if t:
        d = delta if delta is not None else x
        rw, rb = router if router is not None else (x, None)
        _norm_kernel[(t, parts)](
            x, d, weight, xo, y, yq if quant else x, s_buf if quant else x, rw, rb if rb is not None else x,
            logits if logits is not None else x, h, rw.shape[0], eps,
            x.stride(0), d.stride(0), xo.stride(0), y.stride(0), yq.stride(0) if quant else 0,
            s_buf.stride(0) if quant else 0, rw.stride(0), logits.stride(0) if logits is not None else 0,
            HAS_DELTA=delta is not None, QUANT_OUT=quant, ROUTER=router is not None, HAS_RB=rb is not None,
            NG=triton.next_power_of_2(kb), G=BLOCK, EPP=ROUTER_EXPERTS_PER_PROGRAM, FP8_MAX_C=FP8_MAX,
            HW_CVT=x.is_cuda, QUANT_GP=quant_gp, num_warps=num_warps or NUM_WARPS)
    return NormOut(xo, y, yq, s_buf.t() if quant else None, logits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype."""
    return fused_norm(x, None, weight, eps).y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass; x, delta [T, H]."""
    out = fused_norm(x, delta, weight, eps)
    return out.x, out.y
