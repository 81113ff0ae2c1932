"""Building blocks of the few-token MoE kernels (kernels/moe_small.py) and the few-token dense linear
(kernels/dense_small.py): a token's K range quantised in the CTA, one activation row times an expert's
[BN, K-range] weight tile in either MMA orientation, and the split-K arrival counter."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8_quant import quantize_tile
from kernels.moe_gemm import expert_gemm


@triton.jit
def quantise_row_range(x_ptr, xq_ptr, xs_ptr, t, k_lo, k_hi, stride_xt, stride_xqt, stride_xsk,
                       BLOCK_GX: tl.constexpr, FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr):
    """x[t, k_lo:k_hi] in e4m3 1x128 groups to xq / xs (quantize_act_1x128's bits), which the calling CTA's
    K loop then reads back; CTAs of one token and K range write identical bytes."""
    g = k_lo // 128 + tl.arange(0, BLOCK_GX)  # 1x128 groups of this K range
    cols = g[:, None] * 128 + tl.arange(0, 128)[None, :]  # [BGX, 128]
    valid = cols < k_hi
    x = tl.load(x_ptr + t * stride_xt + cols, mask=valid, other=0.0).to(tl.float32)
    q, scale = quantize_tile(x, valid, FP8_MAX_C, HW_CVT)  # [BGX, 128], [BGX]
    tl.store(xq_ptr + t * stride_xqt + cols, q.to(xq_ptr.dtype.element_ty), mask=valid)
    tl.store(xs_ptr + g * stride_xsk + t, scale, mask=g * 128 < k_hi)
    tl.debug_barrier()  # every thread's xq / xs stores precede the K loop's loads


@triton.jit
def row_gemm(a_row_ptr, as_row_ptr, stride_ask, w_ptr, ws_ptr, rn, k_lo, k_hi, stride_wn, stride_wsn,
             stride_wsk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             SCALE_K: tl.constexpr, DOT_F32: tl.constexpr):
    """[BN] fp32 = a[k_lo:k_hi] . W[rn, k_lo:k_hi]^T for one e4m3 activation row with its 1x128
    scales: the grouped path's K loop. The MMA needs 16 or 64 rows; every tile row reads the same
    activation row (L1 hits, no extra HBM bytes) and row 0 is kept."""
    rows = tl.arange(0, BLOCK_M)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = a_row_ptr + rows[:, None] * 0 + offs_k[None, :]  # [BM, BK]
    b_ptrs = w_ptr + rn[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = expert_gemm(acc, a_ptrs, b_ptrs, as_row_ptr + rows * 0, ws_ptr + (rn // SCALE_K) * stride_wsn,
                      k_lo, k_hi, stride_ask, stride_wsk, True, BLOCK_K, SCALE_K, DOT_F32)
    return tl.sum(tl.where((rows == 0)[:, None], acc, 0.0), axis=0)  # row 0


@triton.jit
def row_gemm_swapped(a_row_ptr, as_row_ptr, stride_ask, w_ptr, w_desc, e, n0, ws_ptr, rn, k_lo, k_hi, stride_wn,
                     stride_wsn, stride_wsk, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, TMA: tl.constexpr):
    """row_gemm with A and B swapped: W's [BN, BK] tile is the MMA's M side, so a 64-row wgmma reads
    the e4m3 weights straight from shared memory (mma.sync's 16-row tiles convert every weight to f16
    in registers first), and the activation row, repeated BLOCK_T times, is the narrow N side.
    TMA: the weight tile comes through w_desc ([E, N, K], block [1, BN, BK]) at (e, n0, k): one
    bulk copy per stage instead of per-thread copies; rows past N and columns past K read as zeros."""
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_T)
    w_ptrs = w_ptr + rn[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
    a_ptrs = a_row_ptr + cols[:, None] * 0 + offs_k[None, :]  # [BT, BK], every row the same
    ws_ptrs = ws_ptr + (rn // SCALE_K) * stride_wsn  # [BN]
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # 2880 = 22.5 x 128: the last block is masked
        kmask = tl.arange(0, BLOCK_K) < k_hi - k0
        if TMA:  # split boundaries are whole blocks: only the tensor's own K tail needs filling
            w = tl.reshape(w_desc.load([e, n0, k0]), (BLOCK_N, BLOCK_K))
        else:
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        kb = k0 // SCALE_K
        s = tl.load(ws_ptrs + kb * stride_wsk) * tl.load(as_row_ptr + kb * stride_ask)  # [BN]
        acc += tl.dot(w, tl.trans(a)) * s[:, None]
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    return tl.sum(tl.where((cols == 0)[None, :], acc, 0.0), axis=1)  # column 0


@triton.jit
def tile_gemm(a_row_ptr, as_row_ptr, stride_ask, w_ptr, w_desc, e, n0, ws_ptr, rn, k_lo, k_hi, stride_wn,
              stride_wsn, stride_wsk, SWAP_AB: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, DOT_F32: tl.constexpr):
    """[BN] fp32 partial of one (pair, N tile, K split), either MMA orientation; w_ptr is expert e's
    [N, K] weights, w_desc (TMA, swapped only) all experts'."""
    if SWAP_AB:
        return row_gemm_swapped(a_row_ptr, as_row_ptr, stride_ask, w_ptr, w_desc, e, n0, ws_ptr, rn, k_lo, k_hi,
                                stride_wn, stride_wsn, stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, TMA)
    return row_gemm(a_row_ptr, as_row_ptr, stride_ask, w_ptr, ws_ptr, rn, k_lo, k_hi, stride_wn, stride_wsn,
                    stride_wsk, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, DOT_F32)


@triton.jit
def arrive(sem_ptr, expected):
    """Count this CTA in; True for the last of `expected` arrivals, which also resets the counter."""
    tl.debug_barrier()  # every thread's partial stores precede the release below
    last = tl.atomic_add(sem_ptr, 1, sem="acq_rel") == expected - 1
    if last:
        tl.atomic_xchg(sem_ptr, 0)
    return last
