"""The MoE at one token on the checkpoint's own MXFP4 experts (W4A16): an experiment for issue 27. The model takes
it for one-token steps with Fusion.MXFP4_MOE where it kept those experts (EngineConfig.mxfp4_experts,
--mxfp4-experts: model.loader copies them as stored beside the compute copy); off by default, unmeasured on a GPU.

Why. At batch-1 decode the FP8 MoE streams 4 experts' weights a layer (99.5 MB in 20b, 2.39 GB a step) and is
the largest part of the step (issue27-h200-1: 925 of 2,092 us, 0.61 of copy). The checkpoint stores those experts
in MXFP4: 4-bit e2m1 values with one UE8M0 exponent per 32 inputs, 52.9 MB a layer with the exponents, about
half the FP8 bytes. vLLM and SGLang run gpt-oss on Hopper in that form (W4A16: Triton matmul_ogs or Marlin,
MODEL_SPEC.md 5.2); tandem converts to FP8 (DESIGN.md). At one token the layer is bound by bytes and latency,
not by math, so the question this kernel answers on a GPU is how much of the halved bytes a few-token kernel can
turn into time (benchmarks/moe_mxfp4_b1.py times it against kernels/moe_small.py on the same experts).

Two launches, the shape of kernels/moe_small.py without split-K:
  1. gate_up   one program per (pair, BLOCK_N1 rows of W1). Each program routes its token (top-k + softmax of
               the logits; program (slot 0, tile 0) stores ids and weights for the down launch), streams its
               whole rows once and finishes them: + b1, rounded to x's dtype (the linear's output), clamped
               SwiGLU in fp32, act stored in x's dtype (W4A16: no activation quantisation).
  2. down      one program per (token, BLOCK_N2 rows of W2, slot): whole rows of the slot's expert, + b2, partials
               to fp32 scratch; the last program of a (token, tile) to arrive (kernels/moe_small_tiles.arrive)
               rounds each slot as the reference does (output dtype, times the routing weight, y's dtype) and
               sums the slots in order.

Rows on the CUDA cores (fp32 FMAs), as kernels/fp8_rows.py, 8 codes a 32-bit word (code q = input 8i + q: the low
nibble holds the even input, MODEL_SPEC.md 1.4): each code becomes an exact f16 worth its value / 2^14 by masks
and shifts (two codes a pass in PTX on the GPU, `_DECODE_ASM`; one at a time in the interpreter, `_e2m1_x2p14`), so
W is dequantised without rounding; the 2^14 and the group's exponent meet once per 32 inputs (`exp2(S - 113)`).
Read offline (sass_probe moe_mxfp4), the loop spends ~5.7 instructions a weight at the default tiles: ~2 decoding,
1 converting to fp32, 1 FMA, the rest x loads (through shared memory, with barriers), addresses and group sums.
Same numbers as `kernels.reference.moe` on `model.quant.dequantize_mxfp4` weights up to fp32 summation order.

Shapes: T tokens, H hidden, I intermediate, E experts (El local), P = T * top_k pairs; MXFP4 rows as
[El, N, K/2] u8 (the checkpoint's [El, N, K/32, 16] flattened) with exponents [El, N, K/32] u8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from kernels.moe import _ROUND_CODE, round_as
from kernels.moe_small import _Counters, route_row
from kernels.moe_small_tiles import arrive


@dataclass(slots=True)
class Mxfp4Experts:
    """One rank's experts in the checkpoint's MXFP4 layout (rows flattened); biases in the activation dtype."""

    w1: torch.Tensor  # [El, 2I, H/2] u8, gate/up INTERLEAVED along rows
    w1_exp: torch.Tensor  # [El, 2I, H/32] u8
    b1: torch.Tensor  # [El, 2I]
    w2: torch.Tensor  # [El, H, I/2] u8
    w2_exp: torch.Tensor  # [El, H, I/32] u8
    b2: torch.Tensor | None  # [El, H]
    expert_start: int
    alpha: float
    limit: float

    @property
    def num_local(self) -> int:
        return self.w1.shape[0]

    @staticmethod
    def from_blocks(w1_blocks: torch.Tensor, w1_scales: torch.Tensor, b1: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, b2: torch.Tensor | None, *, expert_start: int = 0, alpha: float,
                    limit: float) -> "Mxfp4Experts":
        """From the checkpoint's [El, N, K/32, 16] blocks and [El, N, K/32] scales (views, no copy)."""
        el, n1, g1, _ = w1_blocks.shape
        el2, n2, g2, _ = w2_blocks.shape
        assert el == el2 and w1_scales.shape == (el, n1, g1) and w2_scales.shape == (el, n2, g2), "MXFP4 shapes"
        return Mxfp4Experts(w1_blocks.reshape(el, n1, g1 * 16), w1_scales, b1, w2_blocks.reshape(el, n2, g2 * 16),
                            w2_scales, b2, expert_start, alpha, limit)


@triton.jit
def _e2m1_x2p14(code):
    """4-bit e2m1 codes (int32 0..15) -> fp32 values times 2^-14, exact: the 3 magnitude bits at f16 bits 11..9
    (exponent's low two, mantissa's top one) and the sign at bit 15 make an f16 worth the e2m1 value / 2^14; the
    code for 0.5 lands on the f16 subnormal 2^-15, which the conversion to fp32 keeps."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# One 32-bit word of codes (code q at bits 4q..4q+3, input 8i + q of the row) -> its 8 values x 2^-14 as fp32, two
# codes per pass: the word shifted so that codes q and q + 4 sit at bits 9..12 of its two 16-bit halves, masked into
# an f16x2 (magnitude bits, then the sign moved up 3 bits), each half converted. The loop at 4-row tiles, before
# the 16-byte group loads: 7.1 SASS instructions a weight against 8.9 decoding one code at a time (sass_probe).
DECODE_SHIFTS = (("shl.b32", 9), ("shl.b32", 5), ("shl.b32", 1), ("shr.u32", 3))  # pass q: codes q and q + 4 to bit 9
_DECODE_PASS = ("{} t, $8, {}; shl.b32 s, t, 3; and.b32 t, t, 0x0E000E00; and.b32 s, s, 0x80008000; "
                "or.b32 t, t, s; mov.b32 {{l, h}}, t; cvt.f32.f16 ${}, l; cvt.f32.f16 ${}, h; ")
_DECODE_ASM = tl.constexpr("{ .reg .b32 t, s; .reg .b16 l, h; "
                           + "".join(_DECODE_PASS.format(op, n, q, q + 4) for q, (op, n) in enumerate(DECODE_SHIFTS))
                           + "}")


@triton.jit
def _decode_word(w, HW_CVT: tl.constexpr):
    """int32 words [..] of 8 codes -> 8 fp32 tensors [..] (code q of each word), values x 2^-14."""
    if HW_CVT:
        return tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    return (_e2m1_x2p14(w & 15), _e2m1_x2p14((w >> 4) & 15), _e2m1_x2p14((w >> 8) & 15),  # the interpreter: no PTX
            _e2m1_x2p14((w >> 12) & 15), _e2m1_x2p14((w >> 16) & 15), _e2m1_x2p14((w >> 20) & 15),
            _e2m1_x2p14((w >> 24) & 15), _e2m1_x2p14((w >> 28) & 15))


# The f16 form (Mxfp4Config.f16_dot, GPU only): products and a word's sum in f16x2 (HFMA2, two weights an
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
F16_PAIRS = ((2, 0), (6, 4), (3, 1), (7, 5))  # (high, low) inputs of each f16x2 pair, in the order of L's and H's halves
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
    w = tl.load(w_ptrs, mask=(og * 4 < KW)[None, :, None], other=0)  # step 0 (PREFETCH)
    ex = tl.load(e_ptrs, mask=(og * 4 < KW)[None, :], other=0)
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
        if LOP:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(_LOP_PAIRS_ASM, "=r,=r,=r,=r,l", [x_at + wi.to(tl.int64) * 16],
                                                       dtype=(tl.int32,) * 4, is_pure=True, pack=1)  # [GB, 4] each
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(_F16_PAIRS_ASM, "=r,=r,=r,=r,l", [x_at + wi.to(tl.int64) * 16],
                                                       dtype=(tl.int32,) * 4, is_pure=True, pack=1)
        w0, w1, w2, w3 = _quarters(w)  # [BN, GB] each: word j of every group
        a0, a1, a2, a3 = _quarters(p0[None, :, :])  # [1, GB] each: pair i (here 0) of word j
        b0, b1, b2, b3 = _quarters(p1[None, :, :])
        c0, c1, c2, c3 = _quarters(p2[None, :, :])
        d0, d1, d2, d3 = _quarters(p3[None, :, :])
        scale = tl.exp2(ex.to(tl.float32) - (_LOP_EXP_BIAS if LOP else _F16_EXP_BIAS))
        if LOP:
            part = tl.inline_asm_elementwise(  # [BN, GB]
                _LOP_DOT_ASM, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3],
                dtype=tl.float32, is_pure=True, pack=1)
            acc += part * scale
        else:
            part = tl.inline_asm_elementwise(
                _F16_DOT_ASM, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3],
                dtype=tl.float32, is_pure=True, pack=1)
            acc += part * scale
        w = w_next
        ex = ex_next
        w_ptrs += 4 * GB
        e_ptrs += GB
    return tl.sum(acc, axis=1)


@triton.jit
def mxfp4_rows_dot(x_ptr, w_ptr, e_ptr, rn, KW, stride_wn, stride_en, BLOCK_N: tl.constexpr, GB: tl.constexpr,
                   HW_CVT: tl.constexpr, DOT: tl.constexpr = 0):
    """fp32 [BN]: sum_k x[k] * W[rn, k] for MXFP4 rows of KW 32-bit words (8 inputs each) with one exponent per 4
    words, GB groups of 32 inputs a step. stride_wn counts groups (16 bytes): the row offset is then a visible
    multiple of 4 words, so each thread's group comes in one 16-byte load and is summed in the thread. x is read in 8
    strided vectors, one per code position. DOT 1 / 2 (on the GPU, x bf16): _rows_dot_f16's e4m3 / LOP3 forms;
    3 / 4 the same with the next step's loads issued first."""
    if DOT > 0 and HW_CVT:
        return _rows_dot_f16(x_ptr, w_ptr, e_ptr, rn, KW, stride_wn, stride_en, BLOCK_N, GB, DOT % 2 == 0, DOT > 2)
    og = tl.arange(0, GB)  # groups of a step
    oj = tl.arange(0, 4)  # words of a group
    w_ptrs = (w_ptr + rn[:, None, None].to(tl.int64) * stride_wn * 4
              + og[None, :, None] * 4 + oj[None, None, :])  # [BN, GB, 4] int32: a thread's group in one load
    e_ptrs = e_ptr + rn[:, None].to(tl.int64) * stride_en + og[None, :]  # [BN, GB]
    acc = tl.zeros((BLOCK_N, GB), dtype=tl.float32)
    for k0 in range(0, KW, 4 * GB):
        gm = k0 + og * 4 < KW  # [GB] whole groups (KW counts whole groups)
        w = tl.load(w_ptrs, mask=gm[None, :, None], other=0)
        d0, d1, d2, d3, d4, d5, d6, d7 = _decode_word(w, HW_CVT)
        xw = x_ptr + 8 * (k0 + og[:, None] * 4 + oj[None, :])  # [GB, 4]: input 8i of each word
        xm = gm[:, None]
        prod = d0 * tl.load(xw, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d1 * tl.load(xw + 1, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d2 * tl.load(xw + 2, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d3 * tl.load(xw + 3, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d4 * tl.load(xw + 4, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d5 * tl.load(xw + 5, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d6 * tl.load(xw + 6, mask=xm, other=0.0).to(tl.float32)[None, :, :]
        prod += d7 * tl.load(xw + 7, mask=xm, other=0.0).to(tl.float32)[None, :, :]  # [BN, GB, 4]
        part = tl.sum(prod, axis=2)  # [BN, GB] one sum per group
        ex = tl.load(e_ptrs, mask=gm[None, :], other=113).to(tl.float32)
        acc += part * tl.exp2(ex - 113.0)  # 2^(S - 127) times the 2^14 of the decode
        w_ptrs += 4 * GB
        e_ptrs += GB
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_mxfp4_kernel(logits_ptr, rw_ptr, ids_ptr, x_ptr, w_ptr, e_ptr, b_ptr, act_ptr, N, KW, I, E,
                          expert_start, num_local, alpha, limit, stride_lt, stride_xt, stride_we, stride_wn,
                          stride_ee, stride_en, stride_be, stride_ap, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_TK: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr,
                          OUT_ROUND: tl.constexpr, PDL: tl.constexpr, HW_CVT: tl.constexpr, DOT: tl.constexpr):
    if PDL:  # launched early: the router's logits and x come from the launch before
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    nt = pid % num_n
    p = pid // num_n
    t = p // TOP_K
    j = p % TOP_K
    writer = ((j == 0) & (nt == 0)).to(tl.int32)
    e = route_row(logits_ptr, rw_ptr, ids_ptr, t, j, writer, E, stride_lt, TOP_K, BLOCK_E, BLOCK_TK) - expert_start
    if (e < 0) | (e >= num_local):
        return  # another EP rank's expert: the down launch skips this slot too
    e64 = e.to(tl.int64)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # wrapped rows read valid memory and are never stored
    v = mxfp4_rows_dot(x_ptr + t * stride_xt, w_ptr + e64 * stride_we, e_ptr + e64 * stride_ee, rn, KW, stride_wn,
                       stride_en, BLOCK_N, GB, HW_CVT, DOT)
    v = round_as(v + tl.load(b_ptr + e64 * stride_be + rn).to(tl.float32), OUT_ROUND)  # the linear's output
    gate, up = tl.split(tl.reshape(v, (BLOCK_N // 2, 2)))  # interleaved rows: 2i = gate_i, 2i + 1 = up_i
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    offs_i = nt * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + p * stride_ap + offs_i, act.to(act_ptr.dtype.element_ty), mask=offs_i < I)


@triton.jit
def _down_mxfp4_kernel(act_ptr, ids_ptr, rw_ptr, w_ptr, e_ptr, b_ptr, part_ptr, sem_ptr, out_ptr, N, KW,
                       expert_start, num_local, stride_ap, stride_we, stride_wn, stride_ee, stride_en, stride_be,
                       stride_pj, stride_pt, stride_ot, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       OUT_ROUND: tl.constexpr, Y_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, GB: tl.constexpr,
                       PDL: tl.constexpr, HW_CVT: tl.constexpr, DOT: tl.constexpr):
    pid = tl.program_id(0)
    j = pid % TOP_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // TOP_K) % num_n
    t = pid // TOP_K // num_n
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    nmask = offs_n < N
    p_ptrs = part_ptr + t * stride_pt + offs_n  # + slot * stride_pj
    if PDL:
        gdc_wait()  # ids, routing weights and act are the gate_up launch's output
    e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
    if (e >= 0) & (e < num_local):
        e64 = e.to(tl.int64)
        y = mxfp4_rows_dot(act_ptr + (t * TOP_K + j) * stride_ap, w_ptr + e64 * stride_we, e_ptr + e64 * stride_ee,
                           rn, KW, stride_wn, stride_en, BLOCK_N, GB, HW_CVT, DOT)
        if HAS_BIAS:  # inside the rounding of the linear's output, as F.linear's bias
            y += tl.load(b_ptr + e64 * stride_be + rn).to(tl.float32)
        tl.store(p_ptrs + j * stride_pj, y, mask=nmask)
    if arrive(sem_ptr + t * num_n + nt, TOP_K):
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(TOP_K):  # slots in order, like the reference's combine
            ej = tl.load(ids_ptr + t * TOP_K + jj) - expert_start
            ejv = tl.full((BLOCK_N,), 0, tl.int32) + ej  # a vector: the interpreter cannot & a scalar mask
            m = nmask & (ejv >= 0) & (ejv < num_local)
            v = tl.load(p_ptrs + jj * stride_pj, mask=m, other=0.0, cache_modifier=".cg")
            y = round_as(round_as(v, OUT_ROUND) * tl.load(rw_ptr + t * TOP_K + jj).to(tl.float32), Y_ROUND)
            out += tl.where(m, y, 0.0)  # another rank's experts add nothing
        tl.store(out_ptr + t * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=nmask)


# TRITON_INTERPRET was set when the kernels were decorated: they run on CPU tensors (the tests), else on a GPU only.
INTERPRETED = isinstance(_down_mxfp4_kernel, InterpretedFunction)


@dataclass(frozen=True, slots=True)
class Mxfp4Config:
    # 8 rows x 32 groups: 8 words a thread a step at 4 warps, ~5.7 SASS instructions a weight (sass_probe; 4 rows:
    # 6.7, the per-step x loads spread over fewer weights; 16 rows: 5.2 at 128 registers)
    block_n1: int = 8  # W1 rows per gate_up program (even: gate/up pairs stay together)
    block_n2: int = 8  # W2 rows per down program
    groups: int = 32  # 32-input groups per K step: 512 bytes of each row (fp8_rows' best width in bytes)
    num_warps: int = 4
    num_stages: int = 3
    pdl: bool = True  # programmatic dependent launch on the GPU (the interpreter has none)
    # "fp32": decoded weights converted to fp32, FMAs; "f16_cvt" / "f16_lop": products and a group's sums in f16x2
    # (_rows_dot_f16), weights decoded by Hopper's e4m3x2 conversion / by integer ops alone. The f16 forms need bf16 x
    # on the GPU (else fp32); the interpreter always sums in fp32
    dot: str = "fp32"
    prefetch: bool = False  # the f16 forms: the next K step's loads before this one's math


def _words(w: torch.Tensor) -> torch.Tensor:
    """[El, N, K/2] u8 codes -> [El, N, K/8] int32 words (a view): the kernels load 8 codes a word, 4 words a group."""
    assert w.stride(-1) == 1 and w.shape[-1] % 16 == 0 and all(st % 16 == 0 for st in w.stride()[:-1]) \
        and w.data_ptr() % 16 == 0, f"MXFP4 rows must view as whole 16-byte groups: {tuple(w.shape)} {w.stride()}"
    return w.view(torch.int32)


class SmallBatchMxfp4MoE:
    """The MXFP4 MoE for a few tokens: `(x [T, H], router_logits [T, E], top_k, Mxfp4Experts) -> [T, H]`."""

    def __init__(self, config: Mxfp4Config | None = None) -> None:
        self.config = config or Mxfp4Config()
        self._counters = _Counters()

    def _launch(self, hw: bool, x: torch.Tensor) -> dict:
        c = self.config
        on = c.pdl and hw
        # the f16 form reads a word's 8 bf16 of x in one 16-byte load: rows must start 16-byte aligned
        f16 = x.dtype == torch.bfloat16 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
        dot = ({"fp32": 0, "f16_cvt": 1, "f16_lop": 2}[c.dot] + 2 * (c.prefetch and c.dot != "fp32")) if f16 else 0
        return dict(GB=c.groups, num_warps=c.num_warps, num_stages=c.num_stages, PDL=on, HW_CVT=hw, DOT=dot,
                    **({"launch_pdl": True} if on else {}))

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: Mxfp4Experts) -> torch.Tensor:
        c = self.config
        assert c.block_n1 % 2 == 0, "gate_up rows come in (gate, up) pairs"
        if x.stride(1) != 1:
            x = x.contiguous()
        if router_logits.stride(1) != 1:
            router_logits = router_logits.contiguous()
        t, h = x.shape
        e = router_logits.shape[1]
        n1, kb1 = w.w1.shape[1], w.w1.shape[2]  # 2I rows, H/2 bytes
        n2, kb2 = w.w2.shape[1], w.w2.shape[2]  # H rows, I/2 bytes
        assert kb1 * 2 == h and n2 == h and kb2 * 2 == n1 // 2, (w.w1.shape, w.w2.shape, x.shape)
        p, dev, hw = t * top_k, x.device, x.device.type == "cuda"
        weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=dev)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
        act = torch.empty(p, n1 // 2, dtype=x.dtype, device=dev)  # [P, I]
        nt1, nt2 = triton.cdiv(n1, c.block_n1), triton.cdiv(n2, c.block_n2)
        w1, w2 = _words(w.w1), _words(w.w2)  # [El, N, K/8] int32: 8 codes a word
        _gate_up_mxfp4_kernel[(p * nt1,)](
            router_logits, weights, ids, x, w1, w.w1_exp, w.b1, act, n1, w1.shape[2], n1 // 2, e, w.expert_start,
            w.num_local, float(w.alpha), float(w.limit), router_logits.stride(0), x.stride(0), w1.stride(0),
            w1.stride(1) // 4, w.w1_exp.stride(0), w.w1_exp.stride(1), w.b1.stride(0), act.stride(0), TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(e), BLOCK_TK=triton.next_power_of_2(top_k), BLOCK_N=c.block_n1,
            OUT_ROUND=_ROUND_CODE[x.dtype], **self._launch(hw, x))
        sems = self._counters.get(t * nt2, dev)
        part = torch.empty(top_k, t, n2, dtype=torch.float32, device=dev)
        out = torch.empty(t, n2, dtype=x.dtype, device=dev)
        b2 = w.b2 if w.b2 is not None else w.b1  # an unused pointer without bias
        _down_mxfp4_kernel[(t * nt2 * top_k,)](
            act, ids, weights, w2, w.w2_exp, b2, part, sems, out, n2, w2.shape[2], w.expert_start, w.num_local,
            act.stride(0), w2.stride(0), w2.stride(1) // 4, w.w2_exp.stride(0), w.w2_exp.stride(1), b2.stride(0),
            part.stride(0), part.stride(1), out.stride(0), TOP_K=top_k, HAS_BIAS=w.b2 is not None,
            OUT_ROUND=_ROUND_CODE[x.dtype], Y_ROUND=_ROUND_CODE[torch.promote_types(x.dtype, weights.dtype)],
            BLOCK_N=c.block_n2, **self._launch(hw, act))
        return out
