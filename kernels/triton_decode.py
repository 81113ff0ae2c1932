"""Paged decode attention (q_len 1 per sequence) in Triton, built for e4m3 pages (issue 26); it also
reads 16-bit and fp32 pages. `TritonAttention` runs it for pure-decode steps (kernels/
triton_attention_backend.py); the generic `_attn_fwd` keeps prefill and mixed steps.

Why a second kernel. The generic kernel reads e4m3 pages at ~0.42 of copy bandwidth (bf16: 0.90), in
the same wall time as bf16 pages: half the bytes buy nothing, so bytes are not its limit; its
instruction count is the likely one. Its SASS per 64-key block and warp (Triton 3.6, sm_90a, 4
warps): 521 instructions against 307 for bf16 pages (2.7x per byte), of them 32 LDS.U8 (PV
needs V with keys as the MMA's K dimension; 8-bit operands cannot be transposed by ldmatrix, so
Triton reads V's smem tile byte by byte), 64 F2F.BF16.F16 + 32 F2FP.F16.E4M3 (sm_90 has no e4m3 ->
bf16 conversion: each pair goes through f16, then each value to bf16 alone), ~100 byte-packing
moves/permutes, and 9 bar.syncs (the 16-row tile, 8 of them padding, is split over 4 warps along
the keys, so every softmax reduction and the P operand cross warps through shared memory).

What this kernel does instead (per 64 keys, one warp: 513 SASS instructions for the 8 KB of e4m3
K and V, 0.06 per byte against the generic kernel's 0.25 on e4m3 and 0.075 on bf16 pages):
  * one program = one (sequence, KV head, split) with the whole GQA group, one warp by default;
  * transposed products: S^T = K Q^T [N, G] and O^T = V^T P^T [D, G], so the G = 8 heads are the
    MMA's n = 8 (no padding rows: half the softmax work of a 16-row tile);
  * e4m3 pages are read as int16 words (two neighbouring dims of one key) into shared memory by
    cp.async: 16-bit elements are what ldmatrix(.trans) moves, so V^T comes out of smem in MMA
    order; each word pair becomes two f16x2 registers with one byte permute and two cvt (inline
    PTX, `_e4m3_pairs`), which splits the head dim into even and odd halves: q and the output are
    split the same way (a permutation of the dot product's terms, exact);
  * f16 MMAs: e4m3 codes are exact in f16 and convert in one instruction per pair (bf16 would need
    three); q (bf16) is exact in f16 up to 2^15, larger rows are scaled by a power of two first;
  * one KV head's page is one contiguous P * D run: a block of BLOCK_N keys is BLOCK_N / P
    contiguous rows at page-table addresses; the next block's page ids are loaded one iteration
    ahead, so Triton's pipeliner can double-buffer the K/V copies (`num_stages`);
  * scales folded: K's into the logit multiplier, V's into the output; the sink starts split 0's
    running max (l = 1), as in `_attn_fwd`; sliding windows mask the first and last blocks; split-KV
    partials merge with `_merge_splits`.

Shape legend: B sequences (= query rows), Hq / Hkv heads, G = Hq / Hkv, D head dim, P page size,
NP pages, S splits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.attention_splits import merge_splits, split_partials
from kernels.triton_attention import LOG2E, AttnBatch, page_scales

FP8 = torch.float8_e4m3fn


@triton.jit
def _e4m3_pairs(w, DOT_F16: tl.constexpr, DT: tl.constexpr, HW_CVT: tl.constexpr):
    """int16 words holding two e4m3 codes (low byte = the even dim) -> (even, odd) codes, exact.
    HW_CVT: per two words one prmt (gather the low bytes and the high bytes) and two paired cvts."""
    if HW_CVT:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 l, h; prmt.b32 t, $2, 0, 0x3120; mov.b32 {l, h}, t; "
            "cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
            "=r,=r,r", [w], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
        if not DOT_F16:
            lo = lo.to(DT)
            hi = hi.to(DT)
    else:  # the interpreter: no PTX
        lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DT)
        hi = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DT)
    return lo, hi


@triton.jit
def _decode_block(o_lo, o_hi, m_i, l_i, q_lo, q_hi, row_base, j0, lo, hi, KB, VB, qk_scale,
                  MASK: tl.constexpr, BLOCK_N: tl.constexpr, KPR: tl.constexpr, HEAD_DIM: tl.constexpr,
                  FP8_PAGES: tl.constexpr, DOT_F16: tl.constexpr, DT: tl.constexpr, DOT_PREC: tl.constexpr,
                  HW_CVT: tl.constexpr):
    """Keys [j0, j0 + BLOCK_N): BLOCK_N / KPR rows of KPR keys, row r at row_base[r] (one page's run).
    MASK: keys outside [lo, hi) are dropped (first / last blocks)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    ROWS: tl.constexpr = BLOCK_N // KPR
    e = tl.arange(0, KPR * HALF)  # FP8: int16 words of a row; else: elements of one half
    if FP8_PAGES:
        off = row_base[:, None] + e[None, :]  # [ROWS, KPR * D/2]
    else:
        off = row_base[:, None] + ((e // HALF) * HEAD_DIM + e % HALF)[None, :]
    if MASK:
        j = j0 + tl.arange(0, ROWS)[:, None] * KPR + (e // HALF)[None, :]
        ok = (j >= lo) & (j < hi)
    if FP8_PAGES:
        if MASK:
            kw = tl.load(KB + off, mask=ok, other=0)
            vw = tl.load(VB + off, mask=ok, other=0)
        else:
            kw = tl.load(KB + off)
            vw = tl.load(VB + off)
        k_lo, k_hi = _e4m3_pairs(tl.reshape(kw, [BLOCK_N, HALF]), DOT_F16, DT, HW_CVT)  # [N, D/2] even / odd dims
        v_lo, v_hi = _e4m3_pairs(tl.reshape(vw, [BLOCK_N, HALF]), DOT_F16, DT, HW_CVT)
    else:  # halves = dims [0, D/2) and [D/2, D)
        if MASK:
            k_lo = tl.load(KB + off, mask=ok, other=0.0)
            k_hi = tl.load(KB + off + HALF, mask=ok, other=0.0)
            v_lo = tl.load(VB + off, mask=ok, other=0.0)
            v_hi = tl.load(VB + off + HALF, mask=ok, other=0.0)
        else:
            k_lo = tl.load(KB + off)
            k_hi = tl.load(KB + off + HALF)
            v_lo = tl.load(VB + off)
            v_hi = tl.load(VB + off + HALF)
        k_lo = tl.reshape(k_lo, [BLOCK_N, HALF]).to(DT)
        k_hi = tl.reshape(k_hi, [BLOCK_N, HALF]).to(DT)
        v_lo = tl.reshape(v_lo, [BLOCK_N, HALF]).to(DT)
        v_hi = tl.reshape(v_hi, [BLOCK_N, HALF]).to(DT)
    s = tl.dot(k_lo, q_lo, input_precision=DOT_PREC)
    s = tl.dot(k_hi, q_hi, s, input_precision=DOT_PREC)  # [N, G] raw logits (codes x q)
    if MASK:  # scaled, then masked (a 0 multiplier must not meet -inf)
        jn = j0 + tl.arange(0, BLOCK_N)
        s = tl.where(((jn >= lo) & (jn < hi))[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.math.exp2(s - m_new[None, :])
    else:  # log2 domain; the multiplier goes into the exp2's FMA (max(c * s) = c * max(s) for c >= 0)
        m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 0)
    p = p.to(DT)
    o_lo = o_lo * alpha[None, :] + tl.dot(tl.trans(v_lo), p, input_precision=DOT_PREC)  # [D/2, G]
    o_hi = o_hi * alpha[None, :] + tl.dot(tl.trans(v_hi), p, input_precision=DOT_PREC)
    return o_lo, o_hi, m_new, l_i


@triton.jit
def _decode_fwd(Q, KC, VC, PT, Sinks, Out, PartAcc, PartM, PartL, KVLens, KScale, VScale,
                num_seqs, num_q_heads, qk_scale, window,
                stride_qt, stride_qh, stride_cp, stride_ch, stride_pt, stride_ot, stride_oh,
                GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                PAGE: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, FP8_PAGES: tl.constexpr,
                DOT_F16: tl.constexpr, DOT_PREC: tl.constexpr, Q_SCALE: tl.constexpr, HW_CVT: tl.constexpr):
    """Grid (B, Hkv, S). Cache strides are in elements of KC (e4m3: bytes); FP8 pages are addressed
    as int16 words below."""
    HALF: tl.constexpr = HEAD_DIM // 2
    KPR: tl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # keys per contiguous row of a block
    ROWS: tl.constexpr = BLOCK_N // KPR
    PAGE_SHIFT: tl.constexpr = PAGE.bit_length() - 1  # PAGE is a power of two; key indices are >= 0
    DT: tl.constexpr = tl.float16 if DOT_F16 else Q.dtype.element_ty
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(KVLens + b)

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kvh * GROUP + g  # [G]
    c = tl.arange(0, HALF)
    if FP8_PAGES:  # the halves are the even / odd dims (how `_e4m3_pairs` splits a word)
        d_lo = 2 * c
        d_hi = 2 * c + 1
    else:
        d_lo = c
        d_hi = c + HALF
    q_row = Q + b.to(tl.int64) * stride_qt + head[None, :] * stride_qh
    q_lo = tl.load(q_row + d_lo[:, None], mask=g_ok[None, :], other=0.0).to(tl.float32)  # [D/2, G] = q^T
    q_hi = tl.load(q_row + d_hi[:, None], mask=g_ok[None, :], other=0.0).to(tl.float32)
    if FP8_PAGES:
        qk_scale = qk_scale * tl.load(KScale + kvh)
    if Q_SCALE:  # bf16 q into f16: rows past 2^14 are scaled by 2^-e (exact), the logits by 2^e
        amax = tl.maximum(tl.max(tl.max(tl.abs(q_lo), 1), 0), tl.max(tl.max(tl.abs(q_hi), 1), 0))
        ex = tl.maximum(tl.floor(tl.log2(amax)) - 13.0, 0.0).to(tl.int32)
        q_lo = q_lo * ((127 - ex) << 23).to(tl.float32, bitcast=True)
        q_hi = q_hi * ((127 - ex) << 23).to(tl.float32, bitcast=True)
        qk_scale = qk_scale * ((127 + ex) << 23).to(tl.float32, bitcast=True)
    q_lo = q_lo.to(DT)
    q_hi = q_hi.to(DT)

    hi = kv_len
    if HAS_WINDOW:
        lo = tl.maximum(kv_len - window, 0)
    else:
        lo = kv_len * 0
    if SPLIT:  # chunks of whole blocks, so only a sequence's last block is partial (no window)
        chunk = tl.cdiv(tl.cdiv(hi - lo, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        s_lo = tl.minimum(lo + split * chunk, hi)
        s_hi = tl.minimum(s_lo + chunk, hi)
    else:
        s_lo = lo
        s_hi = hi
    # rows start on a row boundary inside a page; an empty split (s_lo == s_hi) visits no block
    first = tl.where(s_lo < s_hi, s_lo - s_lo % KPR, s_hi)

    # The sink enters split 0 only: m starts at the raw sink logit (log2 domain) with l = 1.
    sink = tl.load(Sinks + head, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_i = tl.where(split == 0, sink, float("-inf"))
    l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_G], dtype=tl.float32)
    o_lo = tl.zeros([HALF, BLOCK_G], dtype=tl.float32)
    o_hi = tl.zeros([HALF, BLOCK_G], dtype=tl.float32)

    if FP8_PAGES:  # int16 words: every stride halves
        KB = KC.to(tl.pointer_type(tl.int16)) + kvh.to(tl.int64) * (stride_ch // 2)
        VB = VC.to(tl.pointer_type(tl.int16)) + kvh.to(tl.int64) * (stride_ch // 2)
        cp = stride_cp // 2
        row_len = HALF
    else:
        KB = KC + kvh.to(tl.int64) * stride_ch
        VB = VC + kvh.to(tl.int64) * stride_ch
        cp = stride_cp
        row_len = HEAD_DIM
    pt_row = PT + b.to(tl.int64) * stride_pt
    if HAS_WINDOW:  # both ends can be partial: every block masked (a window is 2-3 blocks)
        n_loop = tl.cdiv(s_hi - first, BLOCK_N)
    else:
        n_loop = (s_hi - first) // BLOCK_N
    r = tl.arange(0, ROWS)
    # row r of block i holds keys first + i * BLOCK_N + r * KPR.. (KPR keys, inside one page)
    page = tl.load(pt_row + ((first + r * KPR) >> PAGE_SHIFT), mask=first + r * KPR < s_hi, other=0)  # [ROWS]
    for i in range(0, n_loop):
        j0 = first + i * BLOCK_N
        row_base = page.to(tl.int64) * cp + (((j0 + r * KPR) & (PAGE - 1)) * row_len).to(tl.int64)
        # next block's page ids now: the K/V copies then depend on a loop-carried value, not on a
        # load of the same iteration, and the pipeliner can run them num_stages - 1 blocks ahead
        jn = j0 + BLOCK_N + r * KPR
        page = tl.load(pt_row + (jn >> PAGE_SHIFT), mask=jn < s_hi, other=0)
        o_lo, o_hi, m_i, l_i = _decode_block(o_lo, o_hi, m_i, l_i, q_lo, q_hi, row_base, j0, s_lo, s_hi, KB, VB,
                                             qk_scale, HAS_WINDOW, BLOCK_N, KPR, HEAD_DIM, FP8_PAGES, DOT_F16, DT,
                                             DOT_PREC, HW_CVT)
    if not HAS_WINDOW:
        j0 = first + n_loop * BLOCK_N
        if j0 < s_hi:  # the partial last block
            row_base = page.to(tl.int64) * cp + (((j0 + r * KPR) & (PAGE - 1)) * row_len).to(tl.int64)
            o_lo, o_hi, m_i, l_i = _decode_block(o_lo, o_hi, m_i, l_i, q_lo, q_hi, row_base, j0, s_lo, s_hi, KB,
                                                 VB, qk_scale, True, BLOCK_N, KPR, HEAD_DIM, FP8_PAGES, DOT_F16,
                                                 DT, DOT_PREC, HW_CVT)

    if FP8_PAGES:  # V's scale on the output (partials too: the merge is linear in them)
        v_scale = tl.load(VScale + kvh)
    else:
        v_scale = 1.0
    if SPLIT:
        idx = (split * num_seqs + b) * num_q_heads + head  # [G]
        tl.store(PartM + idx, m_i, mask=g_ok)
        tl.store(PartL + idx, l_i, mask=g_ok)
        acc = PartAcc + idx[None, :].to(tl.int64) * HEAD_DIM
        tl.store(acc + d_lo[:, None], o_lo * v_scale, mask=g_ok[None, :])
        tl.store(acc + d_hi[:, None], o_hi * v_scale, mask=g_ok[None, :])
    else:
        w = v_scale / l_i
        o_row = Out + b.to(tl.int64) * stride_ot + head[None, :] * stride_oh
        tl.store(o_row + d_lo[:, None], (o_lo * w[None, :]).to(Out.dtype.element_ty), mask=g_ok[None, :])
        tl.store(o_row + d_hi[:, None], (o_hi * w[None, :]).to(Out.dtype.element_ty), mask=g_ok[None, :])


# ---- host side ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecodeConfig:
    block_n: int = 64  # keys per inner step (a multiple of the page size, or a divisor of it)
    num_warps: int = 1  # one warp holds a whole (sequence, KV head): no cross-warp softmax
    num_stages: int = 3  # K/V copies in flight: num_stages - 1 blocks ahead
    programs_per_sm: int = 6  # split the KV range until about this many programs per SM
    window_block_n: int = 0  # keys per inner step on sliding-window layers (0: block_n)


# Measured (benchmarks/results/2026-12-03/fp8-kv-1, the decode sweep at 128 x 8k on the H200): one
# warp, 64 keys, 3 stages was the best of 12 configs (3,972 GB/s of e4m3 KV); 2 / 4 warps lost 15-52 %.
DEFAULT_DECODE = DecodeConfig()
# bf16 pages (fp8-kv-2's sweep at 128 x 8k): 2 stages read 3,778 GB/s, 3 stages with 32 keys 3,615, the
# generic kernel 3,526 (a 16-bit block is twice the bytes of an e4m3 one: fewer in flight suffice)
BF16_DECODE = DecodeConfig(num_stages=2)
# ... and at ONE sequence (8 KV heads x 64 splits of one-warp programs, latency-bound): 32 keys, 3 stages. b1-probes-1
# (H100, graph replays of read + merge): 8k full layer 13.09 -> 11.98 us, 32k 32.37 -> 29.79; the sliding layers
# (window 128) read 4.77 us with 2 stages, 4.13 with 3, in 64-key blocks and so one split. Their 32-key blocks would
# split the window in two and add the merge launch (not measured): sliding layers keep 64 keys.
ONE_SEQ_BF16_DECODE = DecodeConfig(block_n=32, num_stages=3, window_block_n=64)


def layer_config(cfg: DecodeConfig, window: int | None) -> DecodeConfig:
    """The config a layer reads with: sliding-window layers take window_block_n keys per step if set."""
    return replace(cfg, block_n=cfg.window_block_n) if window is not None and cfg.window_block_n else cfg


def decode_splits(batch: AttnBatch, num_kv_heads: int, window: int | None, cfg: DecodeConfig,
                  num_sms: int) -> int:
    """Split the KV range only when the grid would leave SMs with few programs, keeping >= 2 blocks
    per split. Host-only (kv_lens of the batch: the capacity under CUDA graphs, so fixed there)."""
    programs = batch.num_seqs * num_kv_heads
    target = num_sms * cfg.programs_per_sm
    if programs >= target:
        return 1
    keys = max(batch.kv_lens, default=0)
    if window is not None:
        keys = min(keys, window)
    useful = max(1, keys // (2 * cfg.block_n))
    return max(1, min(-(-target // programs), useful, 64))


def decode_supported(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """What the kernel handles: power-of-two head dim >= 16, contiguous [P, D] runs per page and head;
    on the GPU head dim >= 32 (the QK products contract half of it, and a GPU dot's K is >= 16) and
    16-bit queries (fp32 ones would take fp32 FMA dots, which spill at one warp: the generic kernel
    serves fp32 models, i.e. tests)."""
    kc = kv_cache[0]
    d, page = q.shape[2], kc.shape[2]
    gpu_ok = not q.is_cuda or (d >= 32 and q.dtype in (torch.bfloat16, torch.float16))
    return (gpu_ok and d >= 16 and d & (d - 1) == 0 and kc.stride(3) == 1 and kc.stride(2) == d
            and page & (page - 1) == 0 and kc.stride() == kv_cache[1].stride())


def paged_decode(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], batch: AttnBatch,
                 sinks: torch.Tensor, sm_scale: float, window: int | None, *,
                 kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None, config: DecodeConfig | None = None,
                 num_splits: int | None = None, num_sms: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one token per sequence, every key already in the pages); kv_cache (k_cache,
    v_cache) [NP, Hkv, P, D] read through batch.page_table [B, maxp] up to batch's kv_len; sinks [Hq]
    fp32 raw logits; e4m3 caches carry kv_scale = (k_scale, v_scale) [Hkv] fp32 (None = 1.0).
    num_sms 0: never split unless num_splits says so (the CPU interpreter). Returns [B, Hq, D]."""
    cfg = layer_config(config or DEFAULT_DECODE, window)
    kc, vc = kv_cache
    b, hq, d = q.shape
    hkv, page = kc.shape[1], kc.shape[2]
    assert b == batch.num_seqs and batch.max_q_len <= 1 and batch.page_table is not None
    assert hq % hkv == 0 and q.stride(2) == 1 and decode_supported(q, kv_cache)
    assert cfg.block_n % page == 0 or page % cfg.block_n == 0, "blocks of whole pages, or pages of whole blocks"
    assert cfg.block_n >= 16 or not q.is_cuda, "the PV product contracts BLOCK_N keys: a GPU dot's K is >= 16"
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    fp8 = kc.dtype == FP8
    dot_f16 = fp8 and q.dtype in (torch.bfloat16, torch.float16)  # e4m3 codes are exact in f16
    if fp8:
        ks, vs = page_scales(kv_scale, hkv, q.device)
    else:
        ks = vs = sinks  # any fp32 pointer: unused
    group = hq // hkv
    splits = num_splits or (decode_splits(batch, hkv, window, cfg, num_sms) if num_sms else 1)
    part_acc, part_m, part_l = split_partials(splits, out)
    pt = batch.page_table
    _decode_fwd[(b, hkv, splits)](
        q, kc, vc, pt, sinks, out, part_acc, part_m, part_l, batch.seq_info[3], ks, vs,
        b, hq, sm_scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), pt.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), BLOCK_N=cfg.block_n, HEAD_DIM=d, PAGE=page,
        SPLIT=splits > 1, HAS_WINDOW=window is not None, FP8_PAGES=fp8, DOT_F16=dot_f16,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", Q_SCALE=dot_f16 and q.dtype == torch.bfloat16,
        HW_CVT=q.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        merge_splits(part_acc, part_m, part_l, out)
    return out
