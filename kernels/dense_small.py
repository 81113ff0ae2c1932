"""Few-token FP8 dense linear: y = x W^T + b for up to 16 tokens, W e4m3 [N, K] with 128x128 block scales,
x quantised to e4m3 1x128 inside the launch: one launch where the linear backends take two (quantise,
GEMM) or three (+ split-K reduce).

Issue 27: at batch 1 the 20b attention projections are bf16 (0.64 GB a step at 1.9-2.9 TB/s: ~650 us of a
2.2-2.4 ms decode step); in FP8 they are half the bytes, but the FP8 linears lost at decode sizes (DeepGEMM's
64-row tiles: 12-14 us for QKV with their quantisation, DG15; a first few-token FP8 kernel streamed 0.3-0.9
TB/s, DG17). This one is the few-token MoE's down kernel (kernels/moe_small.py, ~2.6 TB/s on the experts)
with one "expert": swapped wgmma tiles (W's [BLOCK_N, 128] tile is the MMA's M side, the token the narrow N
side), weights by TMA, K split over the SMs with the last CTA of each output tile summing the partials in
split order (deterministic) and adding the bias in fp32 before the one rounding. Each CTA quantises its own K
range of its token's x first (`quantize_tile`, the bits of `fp8_quant.quantize_act_1x128`; CTAs of one token
and split write identical bytes), so no separate quantisation launch.

At one token a call is bound by its chain of dependent steps (x quantised and stored, read back, 2-3 K blocks,
partials stored, the arrival atomic, the last CTA's sum), not by streaming W: launched early (PDL) behind the norm
and the decode read with its W rows prefetched into L2 before griddepcontrol.wait, it took as long (e4m3 pages)
or 1.6 % longer (bf16) in the 20b step (benchmarks/results/2026-12-06/prefetch-ab-1, at b7db2e3).

Grid: one CTA per (token, N tile, K split). Shapes: T tokens (<= MAX_TOKENS), K in, N out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from kernels.fp8_quant import FP8_DTYPE
from kernels.moe import _ROUND_CODE, round_as, split_range, weight_desc
from kernels.moe_small import _Counters, _num_sms, choose_split
from kernels.moe_small_tiles import arrive, quantise_row_range, tile_gemm
from kernels.reference import BLOCK, FP8_MAX

MAX_TOKENS = 16  # the swapped MMA's narrow side; more tokens take the linear backend
# Tokens up to which the model routes here (registry.Backends.attn_linear). Each token's CTAs read all of W
# (the MoE kernel's layout: one activation row per CTA), so T tokens read it T times: at T = 1 QKV 9.2 us and
# O 7.9 us against bf16 addmm's 10.1 / 11.8, at T = 4 already 17.5 / 14.1 (fp8-gemv-ab-2). Batch-1 only until
# a CTA takes all T rows (as kernels/gemv.py does).
ROUTE_MAX_TOKENS = 1


@triton.jit
def _dense_small_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, b_ptr, part_ptr, sem_ptr, out_ptr, N, K,
                        stride_xt, stride_xqt, stride_xsk, stride_wn, stride_wsn, stride_wsk, stride_ps, stride_pt,
                        stride_ot, HAS_BIAS: tl.constexpr, OUT_ROUND: tl.constexpr, BLOCK_GX: tl.constexpr,
                        SWAP_AB: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALE_K: tl.constexpr,
                        FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched early (programmatic dependent launch): x is the kernel ahead's output
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // SPLIT_K) % num_n
    t = pid // SPLIT_K // num_n
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    quantise_row_range(x_ptr, xq_ptr, xs_ptr, t, k_lo, k_hi, stride_xt, stride_xqt, stride_xsk, BLOCK_GX, FP8_MAX_C,
                       HW_CVT)  # x[t, k_lo:k_hi] in e4m3 1x128 groups, which the K loop below reads back
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # wrapped columns read valid rows and are never stored
    nmask = offs_n < N
    part = tile_gemm(xq_ptr + t * stride_xqt, xs_ptr + t, stride_xsk, w_ptr, w_desc, 0, nt * BLOCK_N, ws_ptr, rn,
                     k_lo, k_hi, stride_wn, stride_wsn, stride_wsk, SWAP_AB, TMA, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K,
                     DOT_F32)  # [BN] fp32
    last = True
    p_ptrs = part_ptr + t * stride_pt + offs_n
    if SPLIT_K > 1:
        tl.store(p_ptrs + ks * stride_ps, part, mask=nmask)
        last = arrive(sem_ptr + t * num_n + nt, SPLIT_K)
    if last:
        v = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_BIAS:
            v += tl.load(b_ptr + rn).to(tl.float32)
        if SPLIT_K == 1:
            v += part
        else:
            for s in tl.static_range(SPLIT_K):  # split order: the same bits every call
                v += tl.load(p_ptrs + s * stride_ps, mask=nmask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + t * stride_ot + offs_n, round_as(v, OUT_ROUND).to(out_ptr.dtype.element_ty), mask=nmask)


INTERPRETED = isinstance(_dense_small_kernel, InterpretedFunction)  # TRITON_INTERPRET: it runs on CPU tensors


@dataclass(frozen=True, slots=True)
class DenseSmallConfig:
    """Tiles of the few-token dense path. split_k 0 = chosen per call for ~ctas_per_sm CTAs per SM."""

    block_m: int = 16  # the token side, padded (the swapped wgmma's N)
    block_n: int = 128  # weight rows per CTA (the swapped wgmma's M); 128 beat 64 for QKV and O (fp8-gemv-ab-2)
    swap_ab: bool = True
    tma: bool = True
    split_k: int = 0
    ctas_per_sm: int = 3
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = False


class FewTokenFp8Linear:
    """y = x W^T + b for T <= MAX_TOKENS, FP8 block-scaled W (kernels.reference.fp8_linear with
    quantize_activations=True, up to fp32 summation order)."""

    def __init__(self, config: DenseSmallConfig | None = None) -> None:
        self.config = config or DenseSmallConfig()
        self._counters = _Counters()
        self._descs: dict[tuple[int, ...], object] = {}  # (data_ptr, N, K, block_n) -> TMA descriptor of W [1, N, K]

    def _desc(self, w: torch.Tensor, c: DenseSmallConfig):
        if not (c.swap_ab and c.tma):
            return None
        key = (w.data_ptr(), *w.shape, c.block_n)
        d = self._descs.get(key)
        if d is None:  # weights live as long as the model: one descriptor each
            d = self._descs[key] = weight_desc(w.unsqueeze(0), c.block_n, BLOCK)
        return d

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        c = self.config
        t, k = x.shape
        n = w.shape[0]
        assert t <= MAX_TOKENS and w.dtype == FP8_DTYPE and w.shape[1] == k and w.stride(1) == 1
        if x.stride(1) != 1:
            x = x.contiguous()
        dev, hw = x.device, x.device.type == "cuda"
        out = torch.empty(t, n, dtype=x.dtype, device=dev)
        if t == 0:
            return out
        nt = triton.cdiv(n, c.block_n)
        s = choose_split(t * nt, k, _num_sms(dev), c.ctas_per_sm, c.split_k)
        xq = torch.empty(t, k, dtype=FP8_DTYPE, device=dev)
        xs = torch.empty(triton.cdiv(k, BLOCK), t, dtype=torch.float32, device=dev).t()  # [T, KB], strides (1, T)
        part = torch.empty(s, t, n, dtype=torch.float32, device=dev) if s > 1 else out
        sems = self._counters.get(t * nt, dev)
        desc = self._desc(w, c)
        b = bias if bias is not None else out
        launch = dict(SWAP_AB=c.swap_ab, TMA=desc is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=BLOCK,
                      SPLIT_K=s, SCALE_K=BLOCK, FP8_MAX_C=FP8_MAX, HW_CVT=hw, DOT_F32=not hw, PDL=c.pdl and hw,
                      num_warps=c.num_warps, num_stages=c.num_stages)
        if c.pdl and hw:
            launch["launch_pdl"] = True
        _dense_small_kernel[(t * nt * s,)](
            x, xq, xs, w, desc, w_scale, b, part, sems, out, n, k, x.stride(0), xq.stride(0), xs.stride(1),
            w.stride(0), w_scale.stride(0), w_scale.stride(1), part.stride(0) if s > 1 else 0,
            part.stride(1) if s > 1 else 0, out.stride(0), HAS_BIAS=bias is not None,
            OUT_ROUND=_ROUND_CODE[x.dtype], BLOCK_GX=triton.next_power_of_2(triton.cdiv(triton.cdiv(k, BLOCK), s)),
            **launch)
        return out


_DEFAULT: FewTokenFp8Linear | None = None


def few_token_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
                         ) -> torch.Tensor:
    """The model's entry (kernels/registry.py Backends.attn_linear, Fusion.FEW_TOKEN_FP8): one shared instance,
    so its split-K counters and TMA descriptors are made once."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = FewTokenFp8Linear()
    return _DEFAULT(x, w, w_scale, bias)
