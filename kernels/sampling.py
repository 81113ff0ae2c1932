"""Fused sampling for temperature > 0: the exponential race of engine.sampling in one pass over the logits.

The torch path samples argmax(softmax(l / T) / q), q ~ Exp(1) hashed from (seed, position, token)
(engine.sampling.exponential_noise): a softmax over [R, V] fp32, ~15 int64 passes for the noise, a
divide and an argmax, outside the CUDA graph (~1 ms per decode step at R = 64, V = 201,088 on an H200:
benchmarks/results/2026-12-03/served-sampled-1). Here, per row:

    argmax_i  p_i / q_i  ==  argmax_i  l_i / T - log q_i

(log p_i = l_i / T - logsumexp is a row constant, so no softmax pass), one read of the logits:
  * the noise bits are the torch path's: the same 64-bit row key from (seed, position), murmur3's
    32-bit finaliser over the token index in uint32 arithmetic (wrapping products, logical shifts:
    the bits of the int64-masked torch code), v = ((h >> 8) + 0.5) / 2^24 rounded alike, and
    q = -log1p(-v): on CUDA libdevice's log1pf (CUDA's), in the interpreter (no libdevice) Goldberg's
    log(1 + x) * x / ((1 + x) - 1), within ~2 ulp;
  * the score's rounding differs from p / q's (l * (1 / T) fused with - log q, no softmax; log q by
    lg2.approx on CUDA), so the chosen token can differ from the torch path's only where two tokens'
    p / q agree to ~1e-6 relative (a near tie: both are draws of the same distribution);
  * greedy rows (noise flag 0) take argmax(l) in the same launch: torch.argmax's answer;
  * -inf logits (grammar masks, min_tokens) score -inf and never win; q = inf (v rounded to 1) scores -inf
    as p / inf = 0 loses in the torch path; a row of only -inf gives 0, as torch.argmax does.

Two launches, no host sync: (1) grid (R, S) programs each take a contiguous chunk of a row (an online
argmax over BLOCK-wide tiles, per lane, reduced once; ties -> lowest index) and write (best score, its
index) partials [R, S];
(2) grid (R,) reduces a row's S partials to the id (ties -> lowest index: torch.argmax's rule).
S is chosen from R so that a batch of 1 still spreads over the SMs; it and R are runtime arguments, so a
new batch size compiles nothing (Sampler.warm_up compiles the kernels for the model's V at start-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK = 1024  # tokens per tile of the online argmax
NUM_WARPS = 4
PROGRAMS_PER_SM = 8  # target programs for one launch (benchmarks/sampling.py sweeps it)
MAX_SPLITS = 256  # programs per row at most: the reduction's width, one compiled variant for every batch size
_SMS: dict[int, int] = {}

_INT32_MAX = 2**31 - 1


@triton.jit
def _row_key(seed_ptr, pos_ptr, row):
    """The row's uint32 key: the torch path's wrapping int64 mix of seed and position, low 32 bits."""
    seed = tl.load(seed_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    key = seed * -7046029254386353131 + pos * -4658895280553007687  # wraps like the torch int64 products
    return (key ^ (key >> 31)).to(tl.uint32)  # the arithmetic shift only touches bits >= 33: truncated away


@triton.jit
def _hash(key, offs):
    """murmur3's finaliser of key + token * golden ratio: uint32 [BLOCK] (wrapping, logical shifts)."""
    h = offs.to(tl.uint32) * 0x9E3779B9 + key
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _log_fast(x, LIBDEVICE: tl.constexpr):
    """log x: lg2.approx on CUDA (~2 instructions, ~1e-7 absolute: far below the score's own fp32
    rounding), the interpreter's exact log elsewhere."""
    if LIBDEVICE:
        return libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _q(h, LIBDEVICE: tl.constexpr):
    """Exp(1) noise fp32 [BLOCK] from hash bits: v in [2^-25, 1] (24 bits), q = -log1p(-v) in (0, inf]."""
    v = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    if LIBDEVICE:
        lp = libdevice.log1p(-v)
    else:  # Goldberg: log1p(x) = log(u) * x / (u - 1), u = 1 + x rounded (exact when u == 1)
        u = 1.0 - v
        lp = tl.where(u == 1.0, -v, tl.log(u) * -v / tl.where(u == 1.0, 1.0, u - 1.0))
    return -lp


@triton.jit(do_not_specialize=["S"])  # S varies with the batch size: one compiled kernel for all
def _partial_kernel(l_ptr, temp_ptr, seed_ptr, pos_ptr, noise_ptr, best_ptr, idx_ptr, V, stride_l, CHUNK,
                    S, BLOCK: tl.constexpr, IMAX: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (row, part): the best score over tokens [part * CHUNK, min(V, (part + 1) * CHUNK)) and its
    index -> best [R, S] fp32, idx [R, S] int32."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * CHUNK
    end = tl.minimum(start + CHUNK, V)
    base = l_ptr + row.to(tl.int64) * stride_l
    noisy = tl.load(noise_ptr + row) != 0
    inv_t = 1.0 / tl.load(temp_ptr + row)
    key = _row_key(seed_ptr, pos_ptr, row)
    # Per lane: the best score so far and its token (strict >: a lane's earlier token keeps a tie); one
    # cross-lane reduction at the end instead of one per tile.
    best = tl.full((BLOCK,), -float("inf"), tl.float32)
    best_i = start + tl.arange(0, BLOCK)  # an all -inf chunk answers its first token
    for off in range(start, end, BLOCK):
        offs = tl.multiple_of(off, BLOCK) + tl.arange(0, BLOCK)  # [BLOCK]; CHUNK is whole tiles
        mask = offs < V
        s = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32)
        if noisy:  # uniform per program: greedy rows skip the hash
            s = s * inv_t - _log_fast(_q(_hash(key, offs), LIBDEVICE), LIBDEVICE)
        better = mask & (s > best)
        best_i = tl.where(better, offs, best_i)
        best = tl.where(better, s, best)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * S + part, top)
    tl.store(idx_ptr + row * S + part, tl.min(tl.where(best == top, best_i, IMAX), axis=0))


@triton.jit(do_not_specialize=["S"])
def _reduce_kernel(best_ptr, idx_ptr, out_ptr, S, SP: tl.constexpr, IMAX: tl.constexpr):
    """Row `row`: the index of the best partial (ties -> lowest token index) -> out [R] int64."""
    row = tl.program_id(0)
    p = tl.arange(0, SP)
    mask = p < S
    b = tl.load(best_ptr + row * S + p, mask=mask, other=-float("inf"))
    i = tl.load(idx_ptr + row * S + p, mask=mask, other=IMAX)
    top = tl.max(b, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(mask & (b == top), i, IMAX), axis=0).to(tl.int64))


@triton.jit
def _noise_kernel(seed_ptr, pos_ptr, h_ptr, q_ptr, V, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Debug/test path: the hash bits (int64 [R, V]) and q (fp32 [R, V]) the sampling kernel draws."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    h = _hash(_row_key(seed_ptr, pos_ptr, row), offs)
    out = row.to(tl.int64) * V + offs
    tl.store(h_ptr + out, h.to(tl.int64), mask=mask)
    tl.store(q_ptr + out, _q(h, LIBDEVICE), mask=mask)


def _splits(r: int, v: int, device: torch.device, block: int, programs_per_sm: int) -> tuple[int, int]:
    """(S programs per row, CHUNK tokens each): ~programs_per_sm x SMs programs in all, >= 1 tile each."""
    sms = 1  # the interpreter runs programs one after another: as if on one SM
    if device.type == "cuda":
        i = device.index if device.index is not None else torch.cuda.current_device()
        sms = _SMS.get(i)
        if sms is None:
            sms = _SMS.setdefault(i, torch.cuda.get_device_properties(i).multi_processor_count)
    target = sms * programs_per_sm
    tiles = triton.cdiv(v, block)
    s = max(1, min(tiles, MAX_SPLITS, triton.cdiv(target, max(r, 1))))
    chunk = triton.cdiv(tiles, s) * block
    return triton.cdiv(v, chunk), chunk


def fused_sample(logits: torch.Tensor, temp: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 noise: torch.Tensor, *, block: int = BLOCK, num_warps: int = NUM_WARPS,
                 programs_per_sm: int = PROGRAMS_PER_SM) -> torch.Tensor:
    """logits [R, V] (any float dtype, unit column stride), temp [R] fp32 (> 0), seeds [R] int64,
    positions [R] int64, noise [R] bool (False: plain argmax, the greedy rows) -> token ids [R] int64.
    Rows with noise sample argmax(softmax(l / T) / q) with the torch path's q. No host sync."""
    r, v = logits.shape
    assert logits.stride(1) == 1 and temp.shape == seeds.shape == positions.shape == noise.shape == (r,)
    assert v < _INT32_MAX
    out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    s, chunk = _splits(r, v, logits.device, block, programs_per_sm)  # chunk: whole tiles (the kernel's mask is < V)
    best = torch.empty(r, s, dtype=torch.float32, device=logits.device)  # [R, S]
    idx = torch.empty(r, s, dtype=torch.int32, device=logits.device)  # [R, S]
    _partial_kernel[(r, s)](logits, temp, seeds, positions, noise.view(torch.uint8), best, idx, v,
                            logits.stride(0), chunk, s, BLOCK=block, IMAX=_INT32_MAX, LIBDEVICE=logits.is_cuda,
                            num_warps=num_warps)
    _reduce_kernel[(r,)](best, idx, out, s, SP=MAX_SPLITS, IMAX=_INT32_MAX, num_warps=1)
    return out


def noise_bits(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds, positions [R] int64 -> (hash bits [R, V] int64 in [0, 2^32), q [R, V] fp32) as fused_sample
    draws them: for tests against engine.sampling.noise_hash / exponential_noise."""
    r = seeds.shape[0]
    h = torch.empty(r, vocab, dtype=torch.int64, device=seeds.device)
    q = torch.empty(r, vocab, dtype=torch.float32, device=seeds.device)
    if r:
        _noise_kernel[(r, triton.cdiv(vocab, BLOCK))](seeds, positions, h, q, vocab, BLOCK=BLOCK,
                                                      LIBDEVICE=seeds.is_cuda)
    return h, q
