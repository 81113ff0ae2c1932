"""The expert GEMM main loops shared by the grouped MoE kernels (kernels/moe.py) and the few-token
path's mma.sync tiles (kernels/moe_small_tiles.py): per-thread copies or TMA weight tiles."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8_gemm import scaled_dot_step


@triton.jit
def native_dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # CPU interpreter only: its bf16 dot multiplies the raw uint16 storage
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def expert_gemm(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k_lo, k_hi, stride_ask, stride_bsk,
                FP8: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BM, BN] += A [BM, k_lo:k_hi] . B [k_lo:k_hi, BN] (pointers at k_lo; k_lo a multiple of
    BLOCK_K), FP8 with per-block scales or native."""
    k_full = k_lo + ((k_hi - k_lo) // BLOCK_K) * BLOCK_K
    for k0 in range(k_lo, k_full, BLOCK_K):
        if FP8:
            acc = scaled_dot_step(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k0, k_hi, stride_ask, stride_bsk,
                                  BLOCK_K, False, SCALE_K)
        else:
            acc = native_dot(tl.load(a_ptrs), tl.load(b_ptrs), acc, DOT_F32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if k_full < k_hi:  # 2880 = 22.5 x 128
        if FP8:
            acc = scaled_dot_step(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k_full, k_hi, stride_ask,
                                  stride_bsk, BLOCK_K, True, SCALE_K)
        else:
            kmask = tl.arange(0, BLOCK_K) < k_hi - k_full
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
            acc = native_dot(a, b, acc, DOT_F32)
    return acc


@triton.jit
def expert_gemm_tma(acc, a_ptrs, w_desc, e, n0, as_ptrs, bs_ptrs, k_lo, k_hi, stride_ask, stride_bsk,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr):
    """expert_gemm's FP8 loop with expert e's weight tile [n0:n0+BN, k0:k0+BK] from a TMA descriptor
    over all experts' [E, N, K] weights: a bulk copy per stage instead of a [BK, BN] pointer tensor
    per thread; rows past N and columns past K arrive as zeros (A is masked past k_hi)."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = tl.arange(0, BLOCK_K) < k_hi - k0
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.trans(tl.reshape(w_desc.load([e, n0, k0]), (BLOCK_N, BLOCK_K)))  # [BK, BN]
        kb = k0 // SCALE_K
        s_a = tl.load(as_ptrs + kb * stride_ask)  # [BM]
        s_b = tl.load(bs_ptrs + kb * stride_bsk)  # [BN]
        acc += tl.dot(a, b) * s_a[:, None] * s_b[None, :]
        a_ptrs += BLOCK_K
    return acc
