"""FP8 e4m3 activation quantisation, 1x128 per token (the DeepSeek recipe), in Triton.

Role: turn a [M, K] bf16/fp32 activation into (e4m3 [M, Kp], fp32 scales) with x ~= q * scale per
1x128 group, the layout each FP8 GEMM backend reads without a further copy:

  * scales are written M-major: a [ceil(K/128), M_al] contiguous buffer returned as its transposed
    view [M, ceil(K/128)] with strides (1, M_al). torch._scaled_mm wants M_al == M exactly;
    DeepGEMM wants M_al a multiple of 4 (16-byte TMA rows); our Triton GEMMs take any strides.
  * K need not be a multiple of 128 (hidden 2880 = 22.5 x 128): the last group is partial and its
    missing columns count as zeros. `k_pad` widens q with zero columns for backends that need an
    aligned K; the scale count ceil(K/128) does not change.

Same arithmetic as `reference.quantize_fp8_per_token`: scale = max(amax, 1e-12) / 448, q =
RTNE(x / scale) saturated to +-448. Compiled, the hardware conversion (cvt.rn.satfinite.e4m3x2)
does exactly that in one instruction. Under TRITON_INTERPRET the fp32->fp8 cast mis-rounds values
that carry into the next binade, so there `round_e4m3` rounds on the e4m3 grid in fp32 first and the
final cast is exact. Both give the reference's bits (the software rounding was the kernel's
bottleneck on the H200: ~25 ALU ops per element, 1.5 TB/s at 8192 x 2880).
The one exception is the group that holds `ones` columns (bias-in-K): its scale is a power of two
(see `quantize_act_1x128`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import BLOCK, FP8_MAX

FP8_DTYPE = torch.float8_e4m3fn


@triton.jit
def round_e4m3(v):
    """fp32 -> fp32 holding the nearest e4m3 value (ties to even), saturated to +-448."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    # e4m3 keeps 3 mantissa bits; below 2^-6 the grid is the subnormal step 2^-9.
    ue = tl.maximum(e, -6) - 3
    ulp = ((ue + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - ue) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(v) * inv_ulp  # exact (power-of-two scaling), t < 16
    r = tl.floor(t + 0.5)
    tie_to_odd = ((r - t) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    r = tl.where(tie_to_odd, r - 1.0, r)
    # the sign from v's bits, so that tiny negatives round to -0 like a cast does (-r would give +0)
    sign = (bits >> 31) << 31
    return ((r * ulp).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def cast_e4m3(v, HW_CVT: tl.constexpr):
    """fp32 -> e4m3 (HW_CVT: compiled) or fp32 holding e4m3 values (interpreter), RTNE, saturating."""
    # One return after a constexpr if/else: with an early return Triton's compiler types both
    # branches and rejects fp8 vs fp32 (only the taken branch of a constexpr if/else is built).
    if HW_CVT:
        q = v.to(tl.float8e4nv)  # the same bits as round_e4m3
    else:
        q = round_e4m3(v)
    return q


@triton.jit
def quantize_tile(x, valid_cols, FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr):
    """x [R, G] fp32 (one 1x128 group per row, invalid columns already 0) -> (q [R, G], scale [R]).
    q is e4m3 (HW_CVT: compiled) or fp32 holding e4m3 values (interpreter); cast it to the output."""
    amax = tl.max(tl.abs(x), axis=1)
    amax = tl.maximum(amax, 1e-12)
    scale = tl.math.div_rn(amax, FP8_MAX_C)
    q = tl.where(valid_cols, tl.math.div_rn(x, scale[:, None]), 0.0)
    return cast_e4m3(q, HW_CVT), scale


@triton.jit
def pow2_scale_tile(x, FP8_MAX_C: tl.constexpr):
    """x [R, G] fp32 -> scale [R] = 2^e, e = ceil(log2(amax / 448)) clamped to [-8, 9]: the scale of
    a group that also carries constant columns, so that the constant's code 2^-e is exact in e4m3
    (2^-9 .. 2^8 are all e4m3 values). Rows with amax > 448 * 2^9 get NaN: the constant cannot be
    exact there, and a NaN row is loud where a lost bias would be silent."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    y = tl.math.div_rn(amax, FP8_MAX_C)  # a normal fp32
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2 y)
    e = tl.maximum(e, -8)
    scale = ((tl.minimum(e, 9) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e > 9, float("nan"), scale)


@triton.jit
def _quant_1x128_kernel(x_ptr, q_ptr, s_ptr, M, K, KP, ONES_COL, stride_xm, stride_qm, stride_sk,
                        BLOCK_M: tl.constexpr, GROUP: tl.constexpr, FP8_MAX_C: tl.constexpr,
                        HW_CVT: tl.constexpr, N_ONES: tl.constexpr):
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = kb * GROUP + tl.arange(0, GROUP)  # [G]
    rmask = rows < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :],
                mask=rmask[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
    valid = cols < K
    q, scale = quantize_tile(x, valid[None, :], FP8_MAX_C, HW_CVT)
    if N_ONES > 0:  # constant columns (the bias rows of an augmented weight) live in this group
        if kb == ONES_COL // GROUP:
            ones = (cols >= ONES_COL) & (cols < ONES_COL + N_ONES)
            scale = pow2_scale_tile(x, FP8_MAX_C)
            inv = 1.0 / scale  # exact: a power of two
            v = tl.where(ones[None, :], inv[:, None], x * inv[:, None])  # x * 2^-e: exact, |v| <= 448
            q = cast_e4m3(tl.where(valid[None, :] | ones[None, :], v, 0.0), HW_CVT)
    # Columns in [K, KP) are the zero padding some backends need.
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < KP)[None, :])
    tl.store(s_ptr + kb * stride_sk + rows, scale, mask=rmask)


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def quantize_act_1x128(x: torch.Tensor, *, k_pad: int | None = None, m_align: int = 1,
                       block_m: int = 16, ones: tuple[int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q e4m3 [M, Kp], scale fp32 [M, ceil(Kp/128)] with strides (1, M_al)).

    Kp = K rounded up to `k_pad` (zero columns) or K; M_al = M rounded up to `m_align`. Groups made
    only of padding get q = 0 and the floor scale 1e-12/448. `ones = (col, n)` puts the constant 1
    into padding columns [col, col + n) (col >= K, one group): the input that multiplies a bias
    stored as weight columns (kernels/deepgemm_linear.py). That group's scale is a power of two,
    2^ceil(log2(amax/448)) clamped to [2^-8, 2^9], so q = 2^-e * scale is exactly 1 (its real columns,
    if any, keep e4m3's relative precision: only the unused top of the range is given up); rows
    with amax > 448 * 2^9 = 229,376 in that group get a NaN scale rather than a wrong bias.
    """
    assert x.dim() == 2, "quantize_act_1x128 takes [M, K]"
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    kp = _round_up(k, k_pad) if k_pad else k
    kb = -(-kp // BLOCK)  # == ceil(K/128) unless k_pad adds whole zero groups (their scale is tiny)
    ones_col, n_ones = ones if ones else (0, 0)
    if n_ones:
        assert ones_col >= k and ones_col // BLOCK == (ones_col + n_ones - 1) // BLOCK
        assert ones_col + n_ones <= kp
    m_al = _round_up(max(m, 1), m_align)
    q = torch.empty(m, kp, dtype=FP8_DTYPE, device=x.device)
    s_buf = torch.empty(kb, m_al, dtype=torch.float32, device=x.device)  # [KB, M_al]
    if m > 0:
        block_m = min(block_m, triton.next_power_of_2(m))
        grid = (triton.cdiv(m, block_m), kb)
        _quant_1x128_kernel[grid](x, q, s_buf, m, k, kp, ones_col, x.stride(0), q.stride(0), s_buf.stride(0),
                                  BLOCK_M=block_m, GROUP=BLOCK, FP8_MAX_C=FP8_MAX, HW_CVT=x.is_cuda,
                                  N_ONES=n_ones, num_warps=4)
    return q, s_buf[:, :m].t()
