"""Store-KV and RoPE in Triton: scatter new K/V into the paged caches by slot_mapping, optionally
rotating K on the way (NeoX half-split RoPE, MODEL_SPEC.md §1.2), plus a RoPE-only variant for Q.

Role: the write half of every attention backend (TritonAttention, FlashInferAttention). Called once
per layer per step, before (pages_hold_all) or after (prefix + dense) the attention read.

slot = page * P + offset; -1 skips the token (a sliding layer's prefill chunk keeps only its
tail). Caches are HND: [NP, Hkv, P, D], so token t of head h lands at cache[page, h, offset, :].
RoPE mirrors `kernels.reference.apply_rope` op for op (cos/sin cast to x's dtype, products and
sums rounded in that dtype, no FMA contraction), so fused and unfused paths store identical bits.

Shape legend: T tokens, H heads (Hkv for K/V, Hq for Q), D head dim, P page size, NP pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_store_kernel(X, V, XC, VC, Slots, Cos, Sin, XOut, num_tokens, num_heads,
                       stride_xt, stride_xh, stride_vt, stride_vh, stride_cp, stride_ch, stride_ct,
                       stride_cos, stride_ot, stride_oh,
                       HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       ROPE: tl.constexpr, STORE: tl.constexpr, WRITE_X: tl.constexpr):
    """A program owns BLOCK_T tokens x all heads; columns e index (head, i) with i < D/2, so each
    column loads both halves it rotates together."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
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
        tl.store(XC + c_dst, y1.to(XC.dtype.element_ty), mask=keep)
        tl.store(XC + c_dst + HALF, y2.to(XC.dtype.element_ty), mask=keep)
        v_off = t64[:, None] * stride_vt + (h * stride_vh + i)[None, :]
        v1 = tl.load(V + v_off, mask=keep, other=0.0)
        v2 = tl.load(V + v_off + HALF, mask=keep, other=0.0)
        tl.store(VC + c_dst, v1.to(VC.dtype.element_ty), mask=keep)
        tl.store(VC + c_dst + HALF, v2.to(VC.dtype.element_ty), mask=keep)


def _launch(x: torch.Tensor, v: torch.Tensor | None, caches: tuple[torch.Tensor, torch.Tensor] | None,
            slot_mapping: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None,
            x_out: torch.Tensor | None) -> None:
    t, h, d = x.shape
    assert d % 2 == 0 and x.stride(2) == 1
    half = d // 2
    if t == 0:
        return
    block_e = triton.next_power_of_2(h * half)
    block_t = max(1, min(16, 4096 // block_e))
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
    _rope_store_kernel[(triton.cdiv(t, block_t),)](
        x, vv, xc, vc, slot_mapping if slot_mapping is not None else dummy,
        cos if cos is not None else dummy, sin if sin is not None else dummy, out, t, h,
        x.stride(0), x.stride(1), vv.stride(0), vv.stride(1), xc.stride(0), xc.stride(1), xc.stride(2),
        cos.stride(0) if cos is not None else 0, out.stride(0), out.stride(1),
        HALF=half, PAGE=xc.shape[2] if caches is not None else 1, BLOCK_T=block_t, BLOCK_E=block_e,
        ROPE=cos is not None, STORE=caches is not None, WRITE_X=x_out is not None,
        num_warps=4, enable_fp_fusion=False)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, Hkv, D] -> caches [NP, Hkv, P, D] at slot_mapping [T] (int64, -1 skips)."""
    _launch(k, v, (k_cache, v_cache), slot_mapping, None, None, None)


def rope_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on k (cos/sin [T, D/2], mscale included), store rotated k and v; returns rotated k
    [T, Hkv, D] (the attention of the same step still reads it densely)."""
    k_rot = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(k, v, (k_cache, v_cache), slot_mapping, cos, sin, k_rot)
    return k_rot


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The Q variant: x [T, H, D] -> rotated copy (or into `out`, which may be x itself)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, None, None, cos, sin, out)
    return out
