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
The f16x2 forms (Mxfp4Config.dot, kernels/moe_mxfp4_f16.py) sum a group's products in HFMA2 instead.
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
from kernels.moe_mxfp4_f16 import _rows_dot_f16
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
