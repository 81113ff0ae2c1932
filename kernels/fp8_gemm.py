"""Dense FP8 block-scaled linear layers with bias: y = x W^T + b, three backends (LinearImpl).

W is e4m3 [N, K] with fp32 128x128 block scales [ceil(N/128), ceil(K/128)]; x is quantised per
token in 1x128 groups (`fp8_quant.quantize_act_1x128`), so every backend computes
`reference.fp8_linear(..., quantize_activations=True)`. Native weights (w_scale None) take a plain
matmul + bias in every backend, so the model also runs unquantised.

  * ScaledMMLinear  torch._scaled_mm (cuBLASLt, DeepSeek 1x128/128x128 recipe). The bias goes into
                    cuBLASLt's epilogue when a one-time probe shows that this torch/cuBLAS accepts
                    it with block scales and gets it right; otherwise one in-place add.
  * TritonFp8Linear our kernel: the fp32 accumulator starts at the bias (the trick the seed used in
                    DeepGEMM), then per 128-wide K block acc += dot(a, b) * s_a[:, None] * s_b.
  (DeepGEMM's kernel, launched by our own host code, is kernels/deepgemm_linear.py.)

A backend's first FP8 call per K runs a small probe on the device (K padding, bias epilogue); run
one warm-up step before CUDA-graph capture.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from common.errors import ConfigError
from kernels import reference as ref
from kernels.fp8_quant import quantize_act_1x128
from kernels.reference import BLOCK
from kernels.tuning import TileConfig, gemm_config


# ---- Triton kernel ---------------------------------------------------------------------------
@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile order for L2 reuse: GROUP_M row tiles sweep all column tiles before moving on."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def scaled_dot_step(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k0, K, stride_ask, stride_bsk,
                    BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, SCALE_K: tl.constexpr):
    """acc [BM, BN] += (A[:, k0:k0+BK] . B[k0:k0+BK, :]) * s_a[:, kb] * s_b[kb, :] for one K block.

    A fresh dot per block keeps the scale promotion in fp32 every <= 128 K elements."""
    if MASK_K:
        kmask = tl.arange(0, BLOCK_K) < K - k0
        a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    ks = k0 // SCALE_K
    s_a = tl.load(as_ptrs + ks * stride_ask)  # [BM]
    s_b = tl.load(bs_ptrs + ks * stride_bsk)  # [BN]
    return acc + tl.dot(a, b) * s_a[:, None] * s_b[None, :]


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALE_K: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    # Out-of-range rows/cols wrap onto valid ones so the loads need no mask; never stored.
    rm = offs_m % M
    rn = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] (W is [N, K], K-major)
    as_ptrs = as_ptr + rm * stride_asm
    bs_ptrs = bs_ptr + (rn // SCALE_K) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    k_full = (K // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        acc = scaled_dot_step(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k0, K, stride_ask, stride_bsk,
                              BLOCK_K, False, SCALE_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if k_full < K:  # K = 2880 leaves a half block
        acc = scaled_dot_step(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k_full, K, stride_ask, stride_bsk,
                              BLOCK_K, True, SCALE_K)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def triton_fp8_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype, cfg: TileConfig | None = None
                    ) -> torch.Tensor:
    """xq e4m3 [M, K], xs fp32 [M, ceil(K/128)] (any strides), w e4m3 [N, K], ws [ceil(N/128),
    ceil(K/128)] -> [M, N] out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    assert w.shape[1] == k and xq.stride(1) == 1 and w.stride(1) == 1
    cfg = cfg or gemm_config(m, n, k)
    assert BLOCK % cfg.block_k == 0 or cfg.block_k % BLOCK == 0
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_gemm_kernel[grid](
        xq, xs, w, ws, bias if bias is not None else ws, out, m, n, k,
        xq.stride(0), xs.stride(0), xs.stride(1), w.stride(0), ws.stride(0), ws.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SCALE_K=BLOCK, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ---- backends --------------------------------------------------------------------------------
def _flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


class TritonFp8Linear:
    name = "triton"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if w_scale is None:
            return F.linear(x, w, bias)
        x2, lead = _flatten(x)
        xq, xs = quantize_act_1x128(x2)
        y = triton_fp8_gemm(xq, xs, w, w_scale, bias, x.dtype)  # [M, N]
        return y.reshape(*lead, w.shape[0])


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


class _DerivedCache:
    """Tensors derived once from a weight (zero-padded copies, expanded scales), keyed by the
    weight's address and checked against a weak reference, so a freed weight's address reused by
    another tensor never returns stale data. Model weights live for the whole process."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, object], tuple[weakref.ref, object]] = {}

    def get(self, src: torch.Tensor, tag: object, make):
        key = (src.data_ptr(), tag)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is src:
            return hit[1]
        value = make()
        self._cache[key] = (weakref.ref(src), value)
        return value


def _pad_k(w: torch.Tensor, ws: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad FP8 weights [N, K] to [N, kp] (scales of whole padding blocks: 1)."""
    n, k = w.shape
    wp = torch.zeros(n, kp, dtype=w.dtype, device=w.device)
    wp[:, :k] = w
    wsp = torch.ones(ws.shape[0], -(-kp // BLOCK), dtype=ws.dtype, device=ws.device)
    wsp[:, : ws.shape[1]] = ws
    return wp, wsp


class _PaddedWeights:
    """Zero-padded copies along K for backends that refuse K = 2880 (doubles those weights)."""

    def __init__(self) -> None:
        self._cache = _DerivedCache()

    def get(self, w: torch.Tensor, ws: torch.Tensor, kp: int, cache: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if kp == w.shape[1]:
            return w, ws
        if not cache:
            return _pad_k(w, ws, kp)
        return self._cache.get(w, ("pad", kp), lambda: _pad_k(w, ws, kp))


def _probe_operands(k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(k)
    x = torch.randn(32, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(256, k, generator=gen).to(device) * 0.05)
    b = torch.randn(256, generator=gen).to(device=device, dtype=torch.bfloat16)
    return x, w, ws, b


def _close(y: torch.Tensor, want: torch.Tensor) -> bool:
    err = (y.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)
    return bool(torch.isfinite(y).all()) and float(err) < 1e-2


class ScaledMMLinear:
    name = "scaled_mm"

    def __init__(self) -> None:
        self._k_pad: dict[int, int] = {}  # K -> padded K that cuBLASLt accepts
        self._bias_epilogue: dict[tuple[int, torch.dtype], bool] = {}
        self._padded = _PaddedWeights()

    def _gemm(self, x2: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
              kp: int, fuse_bias: bool, cache: bool = True) -> torch.Tensor:
        xq, xs = quantize_act_1x128(x2, k_pad=kp)  # xs [M, KB] strides (1, M): what cuBLASLt reads
        wq, wsq = self._padded.get(w, ws, kp, cache)
        out_dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        b = bias.to(out_dtype) if (bias is not None and fuse_bias) else None
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=wsq.t(), bias=b, out_dtype=out_dtype)
        if bias is not None and not fuse_bias:
            y.add_(bias)  # one fused elementwise pass
        return y.to(x2.dtype)

    def _probe(self, k: int, dtype: torch.dtype, device: torch.device) -> None:
        x, w, ws, b = _probe_operands(k, device)
        x = x.to(dtype)
        want = ref.fp8_linear(x, w, ws, b, quantize_activations=True)
        if k not in self._k_pad:
            errors = []
            for kp in dict.fromkeys((k, _round_up(k, BLOCK), _round_up(k, 4 * BLOCK))):
                try:
                    if _close(self._gemm(x, w, ws, b, kp, fuse_bias=False, cache=False), want):
                        self._k_pad[k] = kp
                        break
                    errors.append(f"K={kp}: wrong result")
                except RuntimeError as e:
                    errors.append(f"K={kp}: {str(e).splitlines()[0]}")
            else:
                raise ConfigError(f"torch._scaled_mm block-scaled FP8 unusable for K={k}: {errors}")
        try:
            ok = _close(self._gemm(x, w, ws, b, self._k_pad[k], fuse_bias=True, cache=False), want)
        except RuntimeError:
            ok = False
        self._bias_epilogue[(k, dtype)] = ok

    def describe(self, k: int, dtype: torch.dtype) -> str:
        """After the first call: how this K runs (for benchmark reports and start-up logs)."""
        return (f"K={k} padded to {self._k_pad.get(k)}, bias "
                f"{'in cuBLASLt epilogue' if self._bias_epilogue.get((k, dtype)) else 'as one add'}")

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if w_scale is None:
            return F.linear(x, w, bias)
        if not x.is_cuda:  # cuBLASLt only; on CPU the same function through the reference
            return ref.fp8_linear(x, w, w_scale, bias, quantize_activations=True)
        x2, lead = _flatten(x)
        m, k = x2.shape
        if (k, x.dtype) not in self._bias_epilogue:
            self._probe(k, x.dtype, x.device)
        # cuBLASLt's block-scaled FP8 path refuses some small M (M = 1 seen on the H200 with torch
        # 2.11: CUBLAS_STATUS_NOT_SUPPORTED); M in multiples of 16 worked everywhere measured.
        mp = _round_up(m, 16)
        if mp != m:
            x2 = F.pad(x2, (0, 0, 0, mp - m))
        y = self._gemm(x2, w, w_scale, bias, self._k_pad[k], self._bias_epilogue[(k, x.dtype)])[:m]
        return y.reshape(*lead, w.shape[0])
