"""Store-KV and RoPE in Triton: scatter new K/V into the paged caches by slot_mapping, optionally
rotating K on the way (NeoX half-split RoPE, MODEL_SPEC.md §1.2), plus a RoPE-only variant for Q,
the fused variant (`rope_qk_store_kv`: Q's and K's rotation and the K/V store in one launch), and the
inverse of the store (`gather_kv`: rows of the caches by slot, dequantised, made dense).

Role: the write half of every attention backend (TritonAttention, FlashInferAttention). Called once
per layer per step, before (pages_hold_all) or after (prefix + dense) the attention read.

slot = page * P + offset; -1 skips the token (a sliding layer's prefill chunk keeps only its
tail). Caches are HND: [NP, Hkv, P, D], so token t of head h lands at cache[page, h, offset, :].
RoPE mirrors `kernels.reference.apply_rope` op for op (cos/sin cast to x's dtype, products and
sums rounded in that dtype, no FMA contraction), so fused and unfused paths store identical bits.
FP8 (e4m3) caches: each value is divided exactly (div_rn) by its KV head's scale and rounded to
nearest-even with saturation, the bits of `kernels.reference.quantize_kv` (compiled: one cvt per
pair; interpreter: `round_e4m3` on the e4m3 grid in fp32, then an exact cast).

Shape legend: T tokens, H heads (Hkv for K/V, Hq for Q), D head dim, P page size, NP pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant import cast_e4m3


@triton.jit
def _rope_store_block(pid, X, V, XC, VC, Slots, Cos, Sin, XOut, KScale, VScale, num_tokens, num_heads,
                      stride_xt, stride_xh, stride_vt, stride_vh, stride_cp, stride_ch, stride_ct,
                      stride_cos, stride_ot, stride_oh,
                      HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      ROPE: tl.constexpr, STORE: tl.constexpr, WRITE_X: tl.constexpr, QUANT: tl.constexpr,
                      HW_CVT: tl.constexpr):
    """Token block `pid` (BLOCK_T tokens) x all heads; columns e index (head, i) with i < D/2, so
    each column loads both halves it rotates together. QUANT: the caches are e4m3 with per-head scales."""
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    e = tl.arange(0, BLOCK_E)  # [BE]
    h = e // HALF
    i = e % HALF
    t_ok = t < num_tokens
    ok = t_ok[:, None] & (h < num_heads)[None, :]  # [BT, BE]
    t64 = t.to(tl.int64)
    x_off = t64[:, None] * stride_xt + (h * stride_xh + i)[None, :]
    x1 = tl.load(X + x_off, mask=ok, other=0.0)
    x2 = tl.load(X + x_off + HALF, mask=ok, other=0.0)
    if ROPE:
        c_off = t64[:, None] * stride_cos + i[None, :]
        c = tl.load(Cos + c_off, mask=ok, other=0.0).to(x1.dtype)
        s = tl.load(Sin + c_off, mask=ok, other=0.0).to(x1.dtype)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if WRITE_X:
        o_off = t64[:, None] * stride_ot + (h * stride_oh + i)[None, :]
        tl.store(XOut + o_off, y1, mask=ok)
        tl.store(XOut + o_off + HALF, y2, mask=ok)
    if STORE:
        slot = tl.load(Slots + t, mask=t_ok, other=-1)  # [BT] int64
        keep = ok & (slot >= 0)[:, None]
        page = slot // PAGE
        c_dst = (page * stride_cp + (slot % PAGE) * stride_ct)[:, None] + (h * stride_ch + i)[None, :]
        v_off = t64[:, None] * stride_vt + (h * stride_vh + i)[None, :]
        v1 = tl.load(V + v_off, mask=keep, other=0.0)
        v2 = tl.load(V + v_off + HALF, mask=keep, other=0.0)
        if QUANT:
            h_ok = h < num_heads
            ks = tl.load(KScale + h, mask=h_ok, other=1.0)[None, :]  # [1, BE] fp32
            vs = tl.load(VScale + h, mask=h_ok, other=1.0)[None, :]
            tl.store(XC + c_dst, cast_e4m3(tl.math.div_rn(y1.to(tl.float32), ks), HW_CVT).to(XC.dtype.element_ty),
                     mask=keep)
            tl.store(XC + c_dst + HALF,
                     cast_e4m3(tl.math.div_rn(y2.to(tl.float32), ks), HW_CVT).to(XC.dtype.element_ty), mask=keep)
            tl.store(VC + c_dst, cast_e4m3(tl.math.div_rn(v1.to(tl.float32), vs), HW_CVT).to(VC.dtype.element_ty),
                     mask=keep)
            tl.store(VC + c_dst + HALF,
                     cast_e4m3(tl.math.div_rn(v2.to(tl.float32), vs), HW_CVT).to(VC.dtype.element_ty), mask=keep)
        else:
            tl.store(XC + c_dst, y1.to(XC.dtype.element_ty), mask=keep)
            tl.store(XC + c_dst + HALF, y2.to(XC.dtype.element_ty), mask=keep)
            tl.store(VC + c_dst, v1.to(VC.dtype.element_ty), mask=keep)
            tl.store(VC + c_dst + HALF, v2.to(VC.dtype.element_ty), mask=keep)


@triton.jit
def _rope_store_kernel(X, V, XC, VC, Slots, Cos, Sin, XOut, KScale, VScale, num_tokens, num_heads,
                       stride_xt, stride_xh, stride_vt, stride_vh, stride_cp, stride_ch, stride_ct,
                       stride_cos, stride_ot, stride_oh,
                       HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       ROPE: tl.constexpr, STORE: tl.constexpr, WRITE_X: tl.constexpr, QUANT: tl.constexpr,
                       HW_CVT: tl.constexpr):
    _rope_store_block(tl.program_id(0), X, V, XC, VC, Slots, Cos, Sin, XOut, KScale, VScale, num_tokens, num_heads,
                      stride_xt, stride_xh, stride_vt, stride_vh, stride_cp, stride_ch, stride_ct,
                      stride_cos, stride_ot, stride_oh, HALF, PAGE, BLOCK_T, BLOCK_E, ROPE, STORE, WRITE_X, QUANT,
                      HW_CVT)


@triton.jit
def _qk_rope_store_kernel(Q, K, V, KC, VC, Slots, Cos, Sin, QOut, KOut, KScale, VScale, num_tokens, num_q_heads,
                          num_kv_heads, num_q_programs,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cp, stride_ch, stride_ct, stride_cos, stride_qot, stride_qoh, stride_kot, stride_koh,
                          HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_TQ: tl.constexpr, BLOCK_EQ: tl.constexpr,
                          BLOCK_TK: tl.constexpr, BLOCK_EK: tl.constexpr, WRITE_K: tl.constexpr,
                          STORE_K: tl.constexpr, QUANT: tl.constexpr, HW_CVT: tl.constexpr):
    """The first num_q_programs programs rotate q into QOut; the rest rotate k and store it with v
    (STORE_K; and write rotated k into KOut when WRITE_K): the three launches of the unfused path in one,
    running the same block code, so the bits are the same."""
    pid = tl.program_id(0)
    if pid < num_q_programs:
        _rope_store_block(pid, Q, Q, KC, VC, Slots, Cos, Sin, QOut, KScale, VScale, num_tokens, num_q_heads,
                          stride_qt, stride_qh, 0, 0, stride_cp, stride_ch, stride_ct, stride_cos, stride_qot,
                          stride_qoh, HALF, PAGE, BLOCK_TQ, BLOCK_EQ, True, False, True, False, HW_CVT)
    else:
        _rope_store_block(pid - num_q_programs, K, V, KC, VC, Slots, Cos, Sin, KOut, KScale, VScale, num_tokens,
                          num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ch, stride_ct,
                          stride_cos, stride_kot, stride_koh, HALF, PAGE, BLOCK_TK, BLOCK_EK, True, STORE_K, WRITE_K,
                          QUANT, HW_CVT)


# Tokens per program when the store quantises to e4m3. Each value is divided by its head's scale
# (div_rn, for the reference's exact bits), which makes a program compute-heavy: with 16-token blocks
# one program took ~20 us, so a batch-1 decode step (1 token, 15 masked rows still computed) paid it
# per layer (fusion-ab-1: 20.2 us fused vs 1.7 us on bf16 pages; decode-profile-1: 0.5 ms of a 3.0 ms
# step). One token per program spreads the divisions over the grid.
QUANT_BLOCK_T = 1


def _blocks(num_heads: int, half: int, quant: bool = False) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_T): all heads' half-columns in one row of a block, up to 4096 elements."""
    block_e = triton.next_power_of_2(num_heads * half)
    return block_e, QUANT_BLOCK_T if quant else max(1, min(16, 4096 // block_e))


def _launch(x: torch.Tensor, v: torch.Tensor | None, caches: tuple[torch.Tensor, torch.Tensor] | None,
            slot_mapping: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
            x_out: torch.Tensor | None, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    t, h, d = x.shape
    assert d % 2 == 0 and x.stride(2) == 1
    half = d // 2
    if t == 0:
        return
    quant = caches is not None and caches[0].dtype == torch.float8_e4m3fn
    block_e, block_t = _blocks(h, half, quant)
    dummy = x
    xc, vc = caches if caches is not None else (dummy, dummy)
    if caches is not None:
        assert v is not None and slot_mapping is not None and v.stride(2) == 1
        assert xc.stride() == vc.stride() and xc.stride(3) == 1 and xc.shape[1] == h and xc.shape[3] == d
        assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] == t
    if cos is not None:
        assert sin is not None and cos.shape == (t, half) and cos.stride(1) == 1 and sin.stride() == cos.stride()
    vv = v if v is not None else dummy
    out = x_out if x_out is not None else dummy
    if quant:
        assert vc.dtype == xc.dtype
        ks, vs = kv_scale if kv_scale is not None else (_ones(h, x.device),) * 2
        assert ks.dtype == vs.dtype == torch.float32 and ks.shape == vs.shape == (h,) and ks.is_contiguous()
    else:
        ks = vs = dummy
    _rope_store_kernel[(triton.cdiv(t, block_t),)](
        x, vv, xc, vc, slot_mapping if slot_mapping is not None else dummy,
        cos if cos is not None else dummy, sin if sin is not None else dummy, out, ks, vs, t, h,
        x.stride(0), x.stride(1), vv.stride(0), vv.stride(1), xc.stride(0), xc.stride(1), xc.stride(2),
        cos.stride(0) if cos is not None else 0, out.stride(0), out.stride(1),
        HALF=half, PAGE=xc.shape[2] if caches is not None else 1, BLOCK_T=block_t, BLOCK_E=block_e,
        ROPE=cos is not None, STORE=caches is not None, WRITE_X=x_out is not None, QUANT=quant,
        HW_CVT=x.is_cuda, num_warps=4, enable_fp_fusion=False)


_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _ones(n: int, device: torch.device) -> torch.Tensor:
    t = _ONES.get((n, device))
    if t is None:
        t = _ONES[(n, device)] = torch.ones(n, dtype=torch.float32, device=device)
    return t


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """k/v [T, Hkv, D] -> caches [NP, Hkv, P, D] at slot_mapping [T] (int64, -1 skips). e4m3 caches
    are quantised with kv_scale = (k_scale, v_scale) [Hkv] fp32 (None = 1.0)."""
    _launch(k, v, (k_cache, v_cache), slot_mapping, None, None, None, kv_scale)


def rope_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """RoPE on k (cos/sin [T, D/2], mscale included), store rotated k and v (quantised after RoPE
    into e4m3 caches); returns rotated k [T, Hkv, D] (the attention of the same step still reads it
    densely)."""
    k_rot = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(k, v, (k_cache, v_cache), slot_mapping, cos, sin, k_rot, kv_scale)
    return k_rot


def rope_qk_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None, *, write_k: bool = False,
                     block_tk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch for `apply_rope(q)`, `apply_rope(k)` and `store_kv(rotated k, v)`: q [T, Hq, D],
    k/v [T, Hkv, D] (any row/head strides, e.g. views of the fused QKV output) -> (rotated q [T, Hq, D]
    contiguous, rotated k [T, Hkv, D] if write_k else None); rotated k and v land in the caches at
    slot_mapping (e4m3 caches quantised after RoPE with kv_scale, as `rope_store_kv`). The same bits
    as the three separate launches. For attention that reads every key from the pages after the
    store (decode, pages_hold_all); write_k for a backend that also reads the new keys densely.
    block_tk: tokens per K program (None: `_blocks`' choice; benchmarks/fusion.py sweeps it)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    assert d % 2 == 0 and k.shape == v.shape == (t, hkv, d) and q.stride(2) == k.stride(2) == v.stride(2) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.shape[1] == hkv and k_cache.shape[3] == d and v_cache.dtype == k_cache.dtype
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape[0] == t
    assert cos.shape == (t, half) and cos.stride(1) == 1 and sin.stride() == cos.stride()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if write_k else None
    if t == 0:
        return q_out, k_out
    quant = k_cache.dtype == torch.float8_e4m3fn
    if quant:
        ks, vs = kv_scale if kv_scale is not None else (_ones(hkv, q.device),) * 2
        assert ks.dtype == vs.dtype == torch.float32 and ks.shape == vs.shape == (hkv,) and ks.is_contiguous()
    else:
        ks = vs = q_out
    be_q, bt_q = _blocks(hq, half)
    be_k, bt_k = _blocks(hkv, half, quant)
    bt_k = block_tk or bt_k
    nq = triton.cdiv(t, bt_q)
    ko = k_out if k_out is not None else q_out
    _qk_rope_store_kernel[(nq + triton.cdiv(t, bt_k),)](
        q, k, v, k_cache, v_cache, slot_mapping, cos, sin, q_out, ko, ks, vs, t, hq, hkv, nq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0), q_out.stride(0), q_out.stride(1),
        ko.stride(0), ko.stride(1),
        HALF=half, PAGE=k_cache.shape[2], BLOCK_TQ=bt_q, BLOCK_EQ=be_q, BLOCK_TK=bt_k, BLOCK_EK=be_k,
        WRITE_K=write_k, STORE_K=True, QUANT=quant, HW_CVT=q.is_cuda, num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), contiguous, in one launch: `rope_qk_store_kv`'s kernel storing nothing,
    the bits of two `apply_rope` launches. (Two launches were ~60 us more host time per layer wherever
    attention reads the new keys densely: a mixed step's 12 sliding layers, every fresh prefill.)"""
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    assert d % 2 == 0 and k.shape == (t, hkv, d) and q.stride(2) == k.stride(2) == 1
    assert cos.shape == (t, half) and cos.stride(1) == 1 and sin.stride() == cos.stride()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    be_q, bt_q = _blocks(hq, half)
    be_k, bt_k = _blocks(hkv, half)
    nq = triton.cdiv(t, bt_q)
    _qk_rope_store_kernel[(nq + triton.cdiv(t, bt_k),)](
        q, k, k, q_out, q_out, q_out, cos, sin, q_out, k_out, q_out, q_out, t, hq, hkv, nq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), 0, 0, 0, 0, 0, cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HALF=half, PAGE=1, BLOCK_TQ=bt_q, BLOCK_EQ=be_q, BLOCK_TK=bt_k, BLOCK_EK=be_k,
        WRITE_K=True, STORE_K=False, QUANT=False, HW_CVT=q.is_cuda, num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The Q variant: x [T, H, D] -> rotated copy (or into `out`, which may be x itself)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, cos, sin, out)
    return out


@triton.jit
def _gather_kv_kernel(KC, VC, Slots, KScale, VScale, KOut, VOut, KN, VN, num_rows, num_heads,
                      stride_cp, stride_ch, stride_ct, stride_kn, stride_kh, stride_vn, stride_vh,
                      stride_nkt, stride_nkh, stride_nvt, stride_nvh,
                      HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                      SCALED: tl.constexpr, HAS_NEW: tl.constexpr):
    """A program owns BLOCK_T rows x all heads: out[n, h, :] = cache[page, h, offset, :] * scale[h] for
    slot >= 0; with HAS_NEW a slot s < 0 names row -s - 1 of the new K/V (KN/VN [T, Hkv, D], copied as they are)."""
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    e = tl.arange(0, BLOCK_E)
    h = e // HEAD_DIM
    i = e % HEAD_DIM
    n_ok = n < num_rows
    ok = n_ok[:, None] & (h < num_heads)[None, :]
    slot = tl.load(Slots + n, mask=n_ok, other=0)  # [BT] int64
    cached = ok & (slot >= 0)[:, None]
    src = ((slot // PAGE) * stride_cp + (slot % PAGE) * stride_ct)[:, None] + (h * stride_ch + i)[None, :]
    n64 = n.to(tl.int64)[:, None]
    kx = tl.load(KC + src, mask=cached, other=0.0).to(tl.float32)
    vx = tl.load(VC + src, mask=cached, other=0.0).to(tl.float32)
    if SCALED:
        kx = kx * tl.load(KScale + h, mask=h < num_heads, other=1.0)[None, :]
        vx = vx * tl.load(VScale + h, mask=h < num_heads, other=1.0)[None, :]
    kx = kx.to(KOut.dtype.element_ty)
    vx = vx.to(VOut.dtype.element_ty)
    if HAS_NEW:
        fresh = ok & (slot < 0)[:, None]
        j = (-slot - 1)[:, None]
        kn = tl.load(KN + j * stride_nkt + (h * stride_nkh + i)[None, :], mask=fresh, other=0.0)
        vn = tl.load(VN + j * stride_nvt + (h * stride_nvh + i)[None, :], mask=fresh, other=0.0)
        kx = tl.where(fresh, kn.to(KOut.dtype.element_ty), kx)
        vx = tl.where(fresh, vn.to(VOut.dtype.element_ty), vx)
    tl.store(KOut + n64 * stride_kn + (h * stride_kh + i)[None, :], kx, mask=ok)
    tl.store(VOut + n64 * stride_vn + (h * stride_vh + i)[None, :], vx, mask=ok)


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              kv_scale: tuple[torch.Tensor, torch.Tensor] | None, dtype: torch.dtype,
              new: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of caches [NP, Hkv, P, D] at `slots` [N] (int64, page * P + offset) -> dense (k, v)
    [N, Hkv, D] in `dtype`: e4m3 codes times their head's scale (kv_scale [Hkv] fp32 each; None =
    1.0), rounded once to `dtype` -- `kernels.reference.dequantize_kv(...).to(dtype)` bit for bit.
    The dense attention paths (FlashInfer's ragged kernels) read FP8 pages through this.
    `new` = (k, v) [T, Hkv, D] in `dtype`: a slot s < 0 takes row -s - 1 of them unchanged, so a chunk's
    [cached prefix ; new tokens] keys are built in one launch (FlashInfer's chunk plans, which did it
    in eight indexing ops per layer, ~0.3 ms of host time each sliding layer of a mixed step)."""
    npg, h, page, d = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and slots.dtype == torch.int64
    n = slots.shape[0]
    k_out = torch.empty(n, h, d, dtype=dtype, device=k_cache.device)
    v_out = torch.empty_like(k_out)
    if n == 0:
        return k_out, v_out
    scaled = k_cache.dtype == torch.float8_e4m3fn and kv_scale is not None
    ks, vs = kv_scale if scaled else (k_out, k_out)
    kn, vn = new if new is not None else (k_out, v_out)
    assert kn.dtype == dtype and kn.stride(2) == 1 and vn.stride(2) == 1
    block_e = triton.next_power_of_2(h * d)
    block_t = max(1, min(16, 4096 // block_e))
    _gather_kv_kernel[(triton.cdiv(n, block_t),)](
        k_cache, v_cache, slots, ks, vs, k_out, v_out, kn, vn, n, h, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        HEAD_DIM=d, PAGE=page, BLOCK_T=block_t, BLOCK_E=block_e, SCALED=scaled, HAS_NEW=new is not None, num_warps=4)
    return k_out, v_out
