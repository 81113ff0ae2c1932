"""Fused RMSNorm (and residual add + RMSNorm) in Triton: one kernel per norm instead of the ~6
elementwise/reduction kernels of the torch expression, which at batch-1 decode cost ~1 us each
(profile_decode_b1.txt). Same math as kernels.reference.rms_norm: fp32 statistics, fp32 weight,
result cast to the activation dtype; the residual sum is rounded to the activation dtype first,
as `x = x + y` is in the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, H, eps, stride_x, stride_d, stride_xo, stride_y,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
        x = (x + d).to(x_ptr.dtype.element_ty)  # the residual stream lives in the activation dtype
        tl.store(xo_ptr + row * stride_xo + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w * (xf * tl.rsqrt(var + eps))
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype."""
    t, h = x.shape
    y = torch.empty_like(x)
    if t:
        _rms_norm_kernel[(t,)](x, x, weight, x, y, h, eps, x.stride(0), 0, 0, y.stride(0), HAS_DELTA=False,
                               BLOCK=triton.next_power_of_2(h))
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass; x, delta [T, H]."""
    t, h = x.shape
    xo, y = torch.empty_like(x), torch.empty_like(x)
    if t:
        _rms_norm_kernel[(t,)](x, delta, weight, xo, y, h, eps, x.stride(0), delta.stride(0), xo.stride(0),
                               y.stride(0), HAS_DELTA=True, BLOCK=triton.next_power_of_2(h))
    return xo, y
