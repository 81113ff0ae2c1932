"""Few-token linear (GEMV-like): y = x W^T + b for M <= 16 tokens with bf16 weights, built to stream W
from HBM once at full bandwidth (issue 27: cuBLASLt's split-K addmm read the 20b attention projections
at 1.9 TB/s at batch 1, where the H200 streams ~4 TB/s). Fusion.FEW_TOKEN_LINEAR routes the attention
projections here (kernels/registry.py `Backends.attn_linear`).

Two launches, deterministic (no atomics: the bits never vary run to run):
  1. `_gemv_partial_kernel`, grid (N tiles, S splits of K): each program streams one contiguous
     [BLOCK_N, K / S] band of W in [BLOCK_N, BLOCK_K] tiles (rows of BLOCK_K * 2 bytes: 16-byte
     vector loads, software-pipelined over num_stages), against the matching x tile (tiny, L1/L2
     resident). W is the dot's left operand ("swap AB"): tl.dot's M side is the weight's BLOCK_N rows
     and its N side the 16 (padded) tokens, the smallest MMA tile, so M = 1 costs what M = 16 does
     in bytes. fp32 accumulation; writes its fp32 partial sums [S, M, N].
  2. `_gemv_reduce_kernel`: sums the S partials in a fixed order (s = 0 .. S-1), adds the bias in fp32,
     rounds once to the output dtype. With S = 1 the first kernel does this itself (one launch).

Numerics against torch (F.linear / addmm on cuBLASLt): both accumulate in fp32 and round once, but in
another summation order (cuBLAS picks its own split-K and reduction), and torch's bias path (cuBLASLt's
epilogue or the reduce kernel's beta * C) is not specified to add the bias to the fp32 sum before the one
rounding as we do. So bits may differ from addmm's in the last place; the tests compare both with
tolerance against an fp32 reference and check our bits are the same on every call.

The split is a host heuristic (`split_k`): enough programs to fill the SMs `waves` times over, each
with at least one K tile. Tunables sit in `GemvConfig` (benchmarks/fusion.py sweeps a few).

One token (`GemvConfig.rows_t1` > 0): `_gemv_rows_kernel`, each program owns `rows_t1` whole rows of W and
sums them on the CUDA cores (fp32 FMAs of bf16 products, no MMA padding to 16 tokens, no split, no partials):
a single launch whose only dependent steps are the loads and one reduction. At one token the few-token
kernels measured here are bound by such chains, not by bytes (benchmarks/results/2026-12-06/prefetch-ab-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels.registry import FEW_TOKEN_LINEAR_MAX_TOKENS

BLOCK_M = 16  # tokens per program: the MMA's smallest N side; M < 16 is masked
assert FEW_TOKEN_LINEAR_MAX_TOKENS <= BLOCK_M


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 64  # weight rows per program (the MMA's M side: 64 = one warpgroup's wgmma)
    block_k: int = 128  # columns per tile: 256-byte rows
    num_warps: int = 4
    num_stages: int = 4  # tiles in flight per program (cp.async; 20 KB of shared memory each at 64 x 128 + x)
    waves: int = 4  # programs per SM the split aims for
    split: int | None = None  # K splits; None: split_k's choice (explicit for sweeps and tests)
    reduce_block: int = 1024  # outputs per program of the reduce kernel
    rows_t1: int = 8  # one token: whole W rows per program on _gemv_rows_kernel (0: the MMA path above)
    block_k_t1: int = 512  # ... and the columns per K step there (1 KB of each row)


DEFAULT_CONFIG = GemvConfig()
BF16 = torch.bfloat16

_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """SMs to fill; 1 on the CPU interpreter (programs run one after another there: splitting only costs)."""
    if device.type != "cuda":
        return 1
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def split_k(n: int, k: int, cfg: GemvConfig, sms: int) -> tuple[int, int]:
    """(S splits, K tiles per split) for W [N, K]: about the fewest splits that give >= waves x sms programs
    (N tiles x S), each split a whole number of BLOCK_K tiles and none empty (S <= K tiles). Pure; the
    token count does not enter (every M reads the same bytes)."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    if cfg.split is not None:  # at most the splits asked for (fewer where one would be empty)
        per = triton.cdiv(k_tiles, max(1, cfg.split))
    else:  # floor: at least the programs wanted, each split >= 1 tile
        want = triton.cdiv(cfg.waves * sms, triton.cdiv(n, cfg.block_n))
        per = max(1, k_tiles // max(1, min(want, k_tiles)))
    return triton.cdiv(k_tiles, per), per


@triton.jit
def _round_out(acc, out_ptr, HW_CVT: tl.constexpr):
    """acc fp32 -> the output dtype, round to nearest even. The interpreter's fp32 -> bf16 cast truncates:
    there the fp32 value is rounded to bf16's 8 mantissa bits first (integer RNE), so its cast is exact."""
    if not HW_CVT and out_ptr.dtype.element_ty == tl.bfloat16:
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    return acc.to(out_ptr.dtype.element_ty)


@triton.jit
def _gemv_partial_kernel(x_ptr, w_ptr, b_ptr, part_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                         TILES_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, HW_CVT: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = W[n tile, this split's K] . x[:, same K]^T. DIRECT (one split): + bias,
    rounded into out [M, N]; otherwise the fp32 partial into part [S, M, N]."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_lo = pid_s * TILES_PER_SPLIT * BLOCK_K
    k_hi = tl.minimum(k_lo + TILES_PER_SPLIT * BLOCK_K, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]  # [BN, BK]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # [BM, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_mask = offs_k < k_hi - k0  # only the last tile of K (2880 = 22.5 x 128) is partial
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:  # CPU interpreter only: its bf16 dot multiplies the raw uint16 storage
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc)
        else:
            acc = tl.dot(w, tl.trans(x), acc)  # bf16 products are exact in the fp32 accumulator
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = n_mask[:, None] & m_mask[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], _round_out(acc, out_ptr, HW_CVT), mask=mask)
    else:
        part = part_ptr + pid_s * M * N + offs_m[None, :] * N + offs_n[:, None]
        tl.store(part, acc, mask=mask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, S, stride_om, BLOCK: tl.constexpr,
                        HAS_BIAS: tl.constexpr, HW_CVT: tl.constexpr):
    """out[m, n tile] = round(sum_s part[s, m, n] + bias[n]): s in order, so the bits are fixed."""
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, _round_out(acc, out_ptr, HW_CVT), mask=mask)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HW_CVT: tl.constexpr):
    """One token: out[n] = round(sum_k x[k] W[n, k] + bias[n]) for this program's BLOCK_N whole rows, fp32 FMAs
    per (row, column) lane, then one sum over the lanes: the same order on every call."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BN, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]  # bf16 x bf16 is exact in fp32
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, _round_out(y, out_ptr, HW_CVT), mask=n_mask)


# TRITON_INTERPRET was set when the kernels were decorated: they run on CPU tensors (the tests), else on a GPU only.
INTERPRETED = isinstance(_gemv_partial_kernel, InterpretedFunction)


def few_token_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     cfg: GemvConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] (M <= 16), w [N, K], bias [N] | None, all bf16 (or fp16) -> x w^T + bias [M, N] in x's
    dtype. CUDA-graph safe (the partials come from the caching allocator, no host sync)."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= FEW_TOKEN_LINEAR_MAX_TOKENS, f"{m} tokens: few_token_linear takes <= {FEW_TOKEN_LINEAR_MAX_TOKENS}"
    assert w.shape[1] == k and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16), (x.shape, w.shape)
    assert w.stride(1) == 1 and x.stride(1) == 1, "rows must be contiguous (vector loads along K)"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)  # [M, N]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_((bias if bias is not None else out.new_zeros(n)).expand(m, n))
    b = bias if bias is not None else out  # not read without HAS_BIAS
    if m == 1 and cfg.rows_t1 > 0:
        _gemv_rows_kernel[(triton.cdiv(n, cfg.rows_t1),)](
            x, w, b, out, n, k, w.stride(0), BLOCK_N=cfg.rows_t1, BLOCK_K=cfg.block_k_t1, HAS_BIAS=bias is not None,
            HW_CVT=x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out
    s, per = split_k(n, k, cfg, num_sms(x.device))
    direct = s == 1
    part = out if direct else torch.empty(s, m, n, device=x.device, dtype=torch.float32)  # [S, M, N]
    _gemv_partial_kernel[(triton.cdiv(n, cfg.block_n), s)](
        x, w, b, part, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), per, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DIRECT=direct, HAS_BIAS=bias is not None,
        DOT_F32=not x.is_cuda, HW_CVT=x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not direct:
        _gemv_reduce_kernel[(triton.cdiv(n, cfg.reduce_block), m)](
            part, b, out, m, n, s, out.stride(0), BLOCK=cfg.reduce_block, HAS_BIAS=bias is not None,
            HW_CVT=x.is_cuda, num_warps=4)
    return out
