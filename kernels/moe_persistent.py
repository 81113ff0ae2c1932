"""Persistent variants of the grouped MoE's expert GEMMs (kernels/moe.py), for the mid regime.

Between decode (a few rows per expert: 16-row tiles stream the weights at the copy rate) and prefill
(hundreds of rows: compute-bound, DeepGEMM) lies a mixed step of a few hundred tokens: ~40 routed rows per
expert, one 64-row tile per expert and N tile, every expert's weights read once. There a program's K loop
is short (2880 / 128 = 22.5 blocks) and one program per tile pays its pipeline's fill and its epilogue
(SwiGLU, re-quantisation, stores) with no loads in flight: mixed-step-profile-1 (H100) measured the layer's
weights read at 2.1 TB/s against 2.95 at decode.

Here a grid of `persistent` programs per SM loops over the tiles in use (row tiles of the grouping x N
tiles, N fastest, so concurrent programs share an expert's gathered rows in L2), and the tile loop is
flattened into the K loop (`tl.range(..., flatten=True)`): one software pipeline runs across tile
boundaries, so the next tile's first weight tiles load during this one's epilogue. Same K loop, epilogues
and rounding points as the one-program-per-tile kernels (kernels/moe.py helpers): the same bits.
Only whole-K configs (split_k 1); the grid is fixed by the row capacity, so a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.moe import down_epilogue, expert_tile, gate_up_epilogue

_SMS: dict[int, int] = {}


def num_programs(tiles: int, per_sm: int, device: torch.device) -> int:
    """The persistent grid: per_sm programs per SM, never more than the tiles there can be."""
    if device.type != "cuda":
        return max(1, min(tiles, 4 * per_sm))  # the interpreter: still several tiles per program
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return max(1, min(tiles, per_sm * _SMS[i]))


@triton.jit
def _gate_up_persistent_kernel(x_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, b_ptr, act_ptr, acts_ptr,
                               sorted_ptr, block_expert_ptr, num_rows_ptr, num_progs,
                               N, K, I, num_pairs, alpha, limit,
                               stride_xt, stride_xst, stride_xsk, stride_we, stride_wn, stride_wse, stride_wsn,
                               stride_wsk, stride_be, stride_am, stride_ask,
                               TOP_K: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr, QUANT_OUT: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SCALE_K: tl.constexpr, FP8_MAX_C: tl.constexpr, DOT_F32: tl.constexpr,
                               HW_CVT: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M) * num_n  # row tiles in use: experts without tokens cost nothing
    for tile in tl.range(tl.program_id(0), tiles, num_progs, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] grouped rows
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        tok = tl.where(valid, pair // TOP_K, 0)  # padding rows read token 0, never stored
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = offs_n % N  # N = 2I is even, so wrapped columns keep (gate, up) pairs together
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc += tl.load(b_ptr + e * stride_be + rn).to(tl.float32)[None, :]  # start at b1
        acc = expert_tile(acc, x_ptr, xs_ptr, tok, stride_xt, stride_xst, stride_xsk, w_ptr, w_desc, ws_ptr, e,
                          pid_n * BLOCK_N, rn, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, K, act_ptr,
                          rows, valid, offs_n < N, 0, 0, 0, FP8, TMA, BLOCK_N, BLOCK_K, SCALE_K, DOT_F32, 0, 1)
        gate_up_epilogue(acc, act_ptr, acts_ptr, rows, valid, pid_n, I, alpha, limit, stride_am, stride_ask,
                         QUANT_OUT, BLOCK_M, BLOCK_N, FP8_MAX_C, HW_CVT)


@triton.jit
def _down_persistent_kernel(a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, b_ptr, rw_ptr, y_ptr,
                            sorted_ptr, block_expert_ptr, num_rows_ptr, num_progs, N, K, num_pairs,
                            stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn,
                            stride_wsk, stride_be, stride_ym,
                            FP8: tl.constexpr, TMA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
                            OUT_ROUND: tl.constexpr, DOT_F32: tl.constexpr):
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M) * num_n
    for tile in tl.range(tl.program_id(0), tiles, num_progs, flatten=True):
        pid_m = tile // num_n
        pid_n = tile % num_n
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = offs_n % N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HAS_BIAS:  # b2: one EP rank (or TP rank 0) adds it, inside the routing weight
            acc += tl.load(b_ptr + e * stride_be + rn).to(tl.float32)[None, :]
        acc = expert_tile(acc, a_ptr, as_ptr, rows, stride_am, stride_asm, stride_ask, w_ptr, w_desc, ws_ptr, e,
                          pid_n * BLOCK_N, rn, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, K, y_ptr,
                          rows, valid, offs_n < N, 0, 0, 0, FP8, TMA, BLOCK_N, BLOCK_K, SCALE_K, DOT_F32, 0, 1)
        down_epilogue(acc, rw_ptr, y_ptr, pair, valid, offs_n, N, stride_ym, OUT_ROUND)


def gate_up(x: torch.Tensor, xs: torch.Tensor, w, desc, ws: torch.Tensor, act: torch.Tensor, acts: torch.Tensor,
            g, tiles: int, top_k: int, fp8: bool, quant_out: bool, cfg, launch: dict) -> None:
    """kernels/moe.py gate_up's launch on the persistent grid (its arguments, resolved there)."""
    grid = num_programs(tiles, cfg.persistent, x.device)
    _gate_up_persistent_kernel[(grid,)](
        x, xs, w.w1, desc, ws, w.b1, act, acts, g.sorted_pairs, g.block_expert, g.num_rows, grid,
        w.w1.shape[1], w.w1.shape[2], w.w1.shape[1] // 2, g.num_pairs, float(w.alpha), float(w.limit),
        x.stride(0), xs.stride(0), xs.stride(1) if fp8 else 0,
        w.w1.stride(0), w.w1.stride(1), ws.stride(0), ws.stride(1) if fp8 else 0,
        ws.stride(2) if fp8 else 0, w.b1.stride(0), act.stride(0), acts.stride(0),
        TOP_K=top_k, FP8=fp8, TMA=desc is not None, QUANT_OUT=quant_out, **launch)


def down(act: torch.Tensor, as_: torch.Tensor, w, desc, ws: torch.Tensor, b2: torch.Tensor, weights: torch.Tensor,
         y: torch.Tensor, g, tiles: int, fp8: bool, cfg, launch: dict) -> None:
    """kernels/moe.py down's launch on the persistent grid."""
    grid = num_programs(tiles, cfg.persistent, act.device)
    _down_persistent_kernel[(grid,)](
        act, as_, w.w2, desc, ws, b2, weights, y, g.sorted_pairs, g.block_expert, g.num_rows, grid,
        w.w2.shape[1], w.w2.shape[2], g.num_pairs,
        act.stride(0), as_.stride(0), as_.stride(1) if fp8 else 0,
        w.w2.stride(0), w.w2.stride(1), ws.stride(0), ws.stride(1) if fp8 else 0,
        ws.stride(2) if fp8 else 0, b2.stride(0), y.stride(0),
        FP8=fp8, TMA=desc is not None, HAS_BIAS=w.b2 is not None, **launch)
