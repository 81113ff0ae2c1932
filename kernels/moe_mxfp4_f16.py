"""The f16x2 forms of the MXFP4 one-token MoE's row dot (kernels/moe_mxfp4.py, Mxfp4Config.dot "f16_cvt" and
"f16_lop"), GPU only: a group's 32 products summed in HFMA2 from inline PTX, x read as bf16 inside the asm. The PTX is
checked on the CPU by tests/support/ptx_emu.py (tests/kernels/test_moe_mxfp4.py); the interpreter runs the fp32 form.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The e4m3 form (Mxfp4Config.dot "f16_cvt"): products and a group's sums in f16x2 (HFMA2, two weights an
# instruction) instead of fp32 FMAs after converting every weight. Each byte of codes (inputs 2k, 2k + 1) becomes two
# e4m3 bytes by masks and shifts (e2m1's sign, 2 exponent bits and mantissa bit land in e4m3's sign, low exponent
# bits and top mantissa bit: the e2m1 value / 2^6, subnormals included), and Hopper's cvt.f16x2.e4m3x2 turns each
# pair into an f16x2 in one instruction: L holds the even inputs' codes (0, 2 | 4, 6), H the odd (1, 3 | 5, 7).
# x comes in as bf16 (one 16-byte load of a word's 8 inputs inside the asm: a tl.load of them took Triton's own
# layout and reached the rows' through shared memory with barriers, sass_probe), repacked into the same pairs once
# per (group, word) a thread: f16 holds |x| < 65504 (beyond: saturated). A product is e2m1 x x / 2^6, exact in f16;
# a group's 32 products are summed in f16x2 (rel. 2^-11 an add; the two halves meet in fp32), then in fp32. The
# sum cannot overflow below |x| ~ 20,000 (x here: a norm's output, or act, which the SwiGLU clamp keeps under 56).
_F16_EXP_BIAS = tl.constexpr(127.0 - 6)  # 2^(S - 127) x 2^6
# (high, low) inputs of each f16x2 pair, in the order of L's and H's halves
F16_PAIRS = ((2, 0), (6, 4), (3, 1), (7, 5))
_F16_PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 a, b, c, d; .reg .f32 x0, x1, x2, x3, x4, x5, x6, x7; ld.global.nc.v4.b32 {a, b, c, d}, [$4]; "
    + "".join(f"shl.b32 x{2 * i}, {r}, 16; and.b32 x{2 * i + 1}, {r}, 0xFFFF0000; " for i, r in enumerate("abcd"))
    + "".join(f"cvt.rn.satfinite.f16x2.f32 ${i}, x{hi}, x{lo}; " for i, (hi, lo) in enumerate(F16_PAIRS))
    + "}")
_F16_WORD = ("shl.b32 t, ${w}, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, ${w}, 4; and.b32 u, u, 0x80808080; "
              "or.b32 L, t, u; shr.b32 t, ${w}, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, ${w}, 0x80808080; "
              "or.b32 H, t, u; mov.b32 {{l0, l1}}, L; mov.b32 {{h0, h1}}, H; cvt.rn.f16x2.e4m3x2 f0, l0; "
              "cvt.rn.f16x2.e4m3x2 f1, l1; cvt.rn.f16x2.e4m3x2 f2, h0; cvt.rn.f16x2.e4m3x2 f3, h1; "
              "{first} acc, f0, ${p0}{acc}; fma.rn.f16x2 acc, f1, ${p1}, acc; fma.rn.f16x2 acc, f2, ${p2}, acc; "
              "fma.rn.f16x2 acc, f3, ${p3}, acc; ")
# a group: words $1..$4, pairs $5..$20 (word j's pair i at $5 + 4j + i) -> $0, the 32 products' sum in fp32
_F16_DOT_ASM = tl.constexpr(
    "{ .reg .b32 t, u, L, H, f0, f1, f2, f3, acc; .reg .b16 l0, l1, h0, h1, a, b; .reg .f32 fa, fb; "
    + "".join(_F16_WORD.format(w=1 + j, p0=5 + 4 * j, p1=6 + 4 * j, p2=7 + 4 * j, p3=8 + 4 * j,
                               first="mul.rn.f16x2" if j == 0 else "fma.rn.f16x2", acc="" if j == 0 else ", acc")
              for j in range(4))
    + "mov.b32 {a, b}, acc; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; add.f32 $0, fa, fb; }")


# The LOP3 form (Mxfp4Config.dot "f16_lop"): the same f16x2 sums, decoded without the conversion unit. On the H100
# (any-card-next-1) the e4m3 form ran at 0.49 of copy, 10 % ahead of the FP8 path: Hopper converts 16 values a clock
# per SM, so its 0.5 cvt a weight (and the fp32 form's 1 f16 -> f32 a weight) bound the kernel, not the bytes. Here
# only integer ops and HFMA2 run: code pair (3 - r, 7 - r) of a word sits at bits 12..15 of its halves once shifted
# left by 4r; sign kept at 15, magnitude moved to bits 9..11 (Marlin's FP4 placement) makes an exact f16 worth the e2m1
# value / 2^14. x is scaled by 2^4 (its bf16 exponent + 4: exact) so products, e2m1 x x / 2^10, stay out of f16's
# subnormals but for |e2m1 x x| < 1/16 (absolute error <= 3e-5 there); f16 holds |x| < 4094 (beyond: saturated).
LOP_X_LOG2 = 4
LOP_PAIRS = ((7, 3), (6, 2), (5, 1), (4, 0))  # (high, low) inputs of pass r's f16x2 pair
_LOP_EXP_BIAS = tl.constexpr(127.0 - 14 + LOP_X_LOG2)
_LOP_PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 a, b, c, d; .reg .f32 x0, x1, x2, x3, x4, x5, x6, x7; ld.global.nc.v4.b32 {a, b, c, d}, [$4]; "
    + "".join(f"add.u32 {r}, {r}, {hex((LOP_X_LOG2 << 7) * 0x10001)}; " for r in "abcd")
    + "".join(f"shl.b32 x{2 * i}, {r}, 16; and.b32 x{2 * i + 1}, {r}, 0xFFFF0000; " for i, r in enumerate("abcd"))
    + "".join(f"cvt.rn.satfinite.f16x2.f32 ${i}, x{hi}, x{lo}; " for i, (hi, lo) in enumerate(LOP_PAIRS))
    + "}")
_LOP_PASS = ("{shift}shr.b32 m, v, 3; and.b32 m, m, 0x0E000E00; and.b32 v, v, 0x80008000; or.b32 v, v, m; "
             "{op} acc, v, ${p}{acc}; ")
_LOP_DOT_ASM = tl.constexpr(
    "{ .reg .b32 v, m, acc; .reg .b16 a, b; .reg .f32 fa, fb; "
    + "".join(_LOP_PASS.format(shift=f"mov.b32 v, ${1 + j}; " if r == 0 else f"shl.b32 v, ${1 + j}, {4 * r}; ",
                               op="mul.rn.f16x2" if j == r == 0 else "fma.rn.f16x2", p=5 + 4 * j + r,
                               acc="" if j == r == 0 else ", acc")
              for j in range(4) for r in range(4))
    + "mov.b32 {a, b}, acc; cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; add.f32 $0, fa, fb; }")


@triton.jit
def _quarters(v):
    """[A, B, 4] -> its 4 slices [A, B] (the last dim within a thread: free)."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], 2, 2)))  # a: 0, 2; b: 1, 3
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _rows_dot_f16(x_ptr, w_ptr, e_ptr, rn, KW, stride_wn, stride_en, BLOCK_N: tl.constexpr, GB: tl.constexpr,
                  LOP: tl.constexpr, PREFETCH: tl.constexpr):
    """mxfp4_rows_dot's f16 forms (x bf16): the same tiles, each group's 32 products summed by _F16_DOT_ASM (the
    e4m3 conversions) or, LOP, _LOP_DOT_ASM (integer decode). PREFETCH: the next step's weights and exponents are
    loaded before this step's sums (two steps in flight a thread; without, a step's loads wait for the last's math)."""
    og = tl.arange(0, GB)
    oj = tl.arange(0, 4)
    w_ptrs = (w_ptr + rn[:, None, None].to(tl.int64) * stride_wn * 4
              + og[None, :, None] * 4 + oj[None, None, :])  # [BN, GB, 4] int32
    e_ptrs = e_ptr + rn[:, None].to(tl.int64) * stride_en + og[None, :]  # [BN, GB]
    x_at = x_ptr.to(tl.int64)  # x's row, 16-byte aligned (the wrapper checks)
    acc = tl.zeros((BLOCK_N, GB), dtype=tl.float32)
    if PREFETCH:  # step 0's loads; without, each step loads its own
        w = tl.load(w_ptrs, mask=(og * 4 < KW)[None, :, None], other=0)
        ex = tl.load(e_ptrs, mask=(og * 4 < KW)[None, :], other=0)
    else:
        w = tl.zeros((BLOCK_N, GB, 4), dtype=tl.int32)
        ex = tl.zeros((BLOCK_N, GB), dtype=e_ptr.dtype.element_ty)
    for k0 in range(0, KW, 4 * GB):
        gm = k0 + og * 4 < KW
        if PREFETCH:
            gn = k0 + 4 * GB + og * 4 < KW
            w_next = tl.load(w_ptrs + 4 * GB, mask=gn[None, :, None], other=0)
            ex_next = tl.load(e_ptrs + GB, mask=gn[None, :], other=0)
        else:
            w = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
            ex = tl.load(e_ptrs, mask=gm[None, :], other=0)
            w_next = w
            ex_next = ex
        wi = tl.where(gm[:, None], k0 + og[:, None] * 4 + oj[None, :], 0)  # [GB, 4] words; a masked group reads word 0
        # pure: Triton then gives it the rows' layout (not pure, it took its own and a shared-memory conversion). It
        # cannot move above the launch's griddepcontrol.wait (x is the launch before's output): that sits in an
        # earlier block and this address changes every step
        p0, p1, p2, p3 = tl.inline_asm_elementwise(_LOP_PAIRS_ASM if LOP else _F16_PAIRS_ASM, "=r,=r,=r,=r,l",
                                                   [x_at + wi.to(tl.int64) * 16], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)  # [GB, 4] each
        w0, w1, w2, w3 = _quarters(w)  # [BN, GB] each: word j of every group
        a0, a1, a2, a3 = _quarters(p0[None, :, :])  # [1, GB] each: pair i (here 0) of word j
        b0, b1, b2, b3 = _quarters(p1[None, :, :])
        c0, c1, c2, c3 = _quarters(p2[None, :, :])
        d0, d1, d2, d3 = _quarters(p3[None, :, :])
        part = tl.inline_asm_elementwise(  # [BN, GB]
            _LOP_DOT_ASM if LOP else _F16_DOT_ASM, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3],
            dtype=tl.float32, is_pure=True, pack=1)
        acc += part * tl.exp2(ex.to(tl.float32) - (_LOP_EXP_BIAS if LOP else _F16_EXP_BIAS))
        w = w_next
        ex = ex_next
        w_ptrs += 4 * GB
        e_ptrs += GB
    return tl.sum(acc, axis=1)
