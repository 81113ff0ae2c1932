"""One-token FP8 weights on the CUDA cores (W8A16): y = x W^T + b for one token with W e4m3 [N, K] and its
128x128 block scales, x kept in bf16. Each program owns BLOCK_N whole rows of W (inside one 128-row scale
block), streams them once in [BLOCK_N, BLOCK_K] tiles and sums fp32 FMAs per (row, column) lane, then once
over the lanes: one launch, no split-K partials, no atomics, the same bits on every call. Tiles by K
(`config_for`). Fusion.FP8_ROWS routes one-token FP8 QKV / O projections here (a default fusion).

Why (issue 27): at batch 1 the MMA kernels for FP8 weights are bound by their chain of dependent steps, not
by bytes: x quantised and read back, split-K partials, the last CTA's fix-up (kernels/dense_small.py took QKV
9.2 us for 7.4 MB, 1.5-1.6 TB/s; the few-token MoE's gate_up 25.5 us for 66 MB, 0.61 of copy: b1-probes-1/2).
The bf16 whole-rows kernel (kernels/gemv.py `_gemv_rows_kernel`) showed one token needs no MMA: the FP8 form
streams half its bytes, and keeping x in bf16 drops the activation quantisation altogether.

Numerics: W dequantised exactly (e4m3 * fp32 scale, folded into x per 128-column group: x[k] * s[k // 128]),
fp32 accumulation, one rounding of (sum + bias). This is `reference.fp8_linear(..., quantize_activations=False)`
up to fp32 summation order, and closer to the bf16 model than the W8A8 kernels (x is not quantised).

Shapes: K in, N out, W [N, K] e4m3 row-major, scales [ceil(N/128), ceil(K/128)] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from kernels.fp8_quant import FP8_DTYPE
from kernels.gemv import _round_out
from kernels.reference import BLOCK


@triton.jit
def rows_dot(x_ptr, w_ptr, ws_ptr, offs_n, nmask, K, stride_wn, stride_wsk, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """fp32 [BN]: sum_k x[k] * W[n, k] * s[k // 128] for rows offs_n of one 128-row scale block (ws_ptr points
    at that block's scale row), in BLOCK_K-column steps (a multiple of 128), x read as a vector with each
    column's scale. A form with 128-column steps and one scalar scale a step (x loaded in the tile's shape, no
    shared-memory layout conversion) measured slower: QKV 9.8 against 7.6 us (rows-b1-ab-2..4)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < K
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        xs = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32) * \
            tl.load(ws_ptr + (kk // 128) * stride_wsk, mask=kmask, other=0.0)  # [BK]
        acc += w.to(tl.float32) * xs[None, :]
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_rows_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, N, K, stride_wn, stride_wsn, stride_wsk,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HW_CVT: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # launched early (programmatic dependent launch): x is the kernel ahead's output
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    y = rows_dot(x_ptr, w_ptr, ws_ptr + ((pid * BLOCK_N) // 128) * stride_wsn, offs_n, nmask, K, stride_wn,
                 stride_wsk, BLOCK_N, BLOCK_K)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, _round_out(y, out_ptr, HW_CVT), mask=nmask)


@dataclass(frozen=True, slots=True)
class RowsConfig:
    block_n: int = 8  # whole W rows per program (divides 128: a program's rows share one scale row)
    block_k: int = 512  # columns per K step, a multiple of 128
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = True  # programmatic dependent launch on the GPU (the interpreter has none)


def config_for(k: int) -> RowsConfig:
    """The tiles by K: 4 rows a program, 512 columns a step below K 4,096 and 1,024 from there. Weights from HBM on
    an H100 (rows-b1-ab-2/3): QKV (K 2,880) 4 x 512 7.54 us against 8 x 512's 8.05; O (K 4,096) 4 x 1024 6.33-6.36
    against 8.03-8.16 (dense_small: 10.45-10.53 / 9.10-9.21)."""
    return RowsConfig(block_n=4, block_k=1024 if k >= 4096 else 512)


# TRITON_INTERPRET was set when the kernel was decorated: it runs on CPU tensors (the tests), else on a GPU only.
INTERPRETED = isinstance(_fp8_rows_kernel, InterpretedFunction)


def pdl_launch(cfg_pdl: bool, hw: bool) -> dict:
    """The PDL flag and launch option of one launch (the CPU interpreter has neither)."""
    on = cfg_pdl and hw
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def fp8_rows_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    cfg: RowsConfig | None = None) -> torch.Tensor:
    """x [1, K] bf16/fp16, w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)] fp32, bias [N] | None -> [1, N] in
    x's dtype. cfg None: config_for(K). CUDA-graph safe (no host sync, no scratch)."""
    m, k = x.shape
    cfg = cfg or config_for(k)
    n = w.shape[0]
    assert m == 1, f"{m} tokens: fp8_rows_linear takes one (each token would re-read W)"
    assert w.dtype == FP8_DTYPE and w.shape[1] == k and w.stride(1) == 1 and x.stride(1) == 1, \
        (w.dtype, w.shape, x.shape)
    assert w_scale.shape == (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)), (w_scale.shape, w.shape)
    assert BLOCK % cfg.block_n == 0, "a program's rows must share one 128-row scale block"
    assert cfg.block_k % BLOCK == 0
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)  # [1, N]
    if n == 0:
        return out
    hw = x.is_cuda
    _fp8_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, w_scale, bias if bias is not None else out, out, n, k, w.stride(0), w_scale.stride(0),
        w_scale.stride(1), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None, HW_CVT=hw,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(cfg.pdl, hw))
    return out
