"""Dense FP8 linear for a few tokens (decode): y [M, N] = x [M, K] W^T + b, M <= MAX_ROWS, one launch.

At decode sizes the block-scaled GEMMs are latency-bound: DeepGEMM's 64x128 tile gives N / 128
CTAs (QKV 40, O 23 for 132 SMs) and, with the separate activation quantisation, loses to the bf16
GEMV that reads twice the bytes (run DG15: QKV at M = 1 12.1 vs 10.4 us). Here, per program:

  * W's [BLOCK_N, 128] tile is the MMA's M side (64-row wgmma straight from e4m3 in shared
    memory) and the padded token rows the narrow N side, as in the few-token MoE (moe_small_tiles);
  * the activations are quantised 1x128 inside the K loop (the tokens are few, every program
    re-quantises its K range in registers): the same codes and scales as `quantize_act_1x128`,
    so the result is `reference.fp8_linear(..., quantize_activations=True)` like every backend's;
  * K is split so that ~ctas_per_sm CTAs per SM stream weights; the last split to arrive sums the
    fp32 partials in split order (deterministic), adds the bias and writes the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import quantize_tile
from kernels.moe import split_range
from kernels.moe_small import Counters, choose_split, num_sms
from kernels.moe_small_tiles import arrive
from kernels.reference import BLOCK, FP8_MAX

MAX_ROWS = 64  # the token side is one wgmma N tile of up to 64


@triton.jit
def _dense_small_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, part_ptr, sem_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_wsn, stride_ps, stride_pt, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
                        HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    nt = pid // SPLIT_K
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rn = offs_n % N  # a last tile's rows past N wrap onto valid ones (loads unmasked, never stored)
    nmask = offs_n < N
    rows = tl.arange(0, BLOCK_T)  # [BT] token rows
    tmask = rows < M
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # 2880 = 22.5 x 128: the last block is masked
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # [BT, BK]
        xq, xs = quantize_tile(x, kmask[None, :], FP8_MAX_C, HW_CVT)  # [BT, BK] e4m3, [BT]
        w = tl.load(w_ptr + rn[:, None] * stride_wn + cols[None, :], mask=kmask[None, :], other=0.0)  # [BN, BK]
        s = tl.load(ws_ptr + (rn // BLOCK_K) * stride_wsn + k0 // BLOCK_K)  # [BN] 128x128 block scales
        if DOT_F32:  # CPU interpreter: xq is fp32 holding e4m3 values
            d = tl.dot(w.to(tl.float32), tl.trans(xq))
        else:
            d = tl.dot(w, tl.trans(xq))  # e4m3 x e4m3 -> fp32, one 128-wide block per dot
        acc += d * s[:, None] * xs[None, :]
    out_ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]  # [BN, BT]: y transposed
    omask = nmask[:, None] & tmask[None, :]
    if SPLIT_K > 1:
        p_ptrs = part_ptr + rows[None, :] * stride_pt + offs_n[:, None]
        tl.store(p_ptrs + ks * stride_ps, acc, mask=omask)
        if arrive(sem_ptr + nt, SPLIT_K):
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for s_ in tl.static_range(SPLIT_K):  # split order: the same sum whichever CTA is last
                acc += tl.load(p_ptrs + s_ * stride_ps, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@dataclass(frozen=True, slots=True)
class DenseSmallConfig:
    block_n: int = 64  # W rows per program: the wgmma's M (64)
    split_k: int = 0  # 0: chosen per call (choose_split: ~ctas_per_sm CTAs per SM)
    ctas_per_sm: int = 3
    num_warps: int = 4
    num_stages: int = 3


_COUNTERS = Counters()


def dense_fp8_small(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                    cfg: DenseSmallConfig = DenseSmallConfig()) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, M <= MAX_ROWS), w e4m3 [N, K], ws fp32 [ceil(N/128), ceil(K/128)],
    bias [N] or None -> [M, N] in x.dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and ws.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    hw = x.device.type == "cuda"
    block_t = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or choose_split(tiles, k, num_sms(x.device), cfg.ctas_per_sm, 0)
    part = torch.empty(split, block_t, n, dtype=torch.float32, device=x.device) if split > 1 else out
    sem = _COUNTERS.get(tiles, x.device)
    _dense_small_kernel[(tiles * split,)](
        x, w, ws, bias if bias is not None else ws, part, sem, out, m, n, k,
        x.stride(0), w.stride(0), ws.stride(0), part.stride(0) if split > 1 else 0,
        part.stride(1) if split > 1 else 0, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_T=block_t, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, SPLIT_K=split,
        FP8_MAX_C=FP8_MAX, HW_CVT=hw, DOT_F32=not hw, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
