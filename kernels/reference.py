"""Plain-torch reference ops: the ground truth for the model's reference backend and for every
kernel parity test. Written for clarity, not speed; every formula is MODEL_SPEC.md §1.2.

Shape legend: T = query tokens of a step (packed over sequences), B = sequences, Hq / Hkv = query /
KV heads, D = head dim, P = page size, NP = pages in a pool, E = experts, H = hidden, I = expert
intermediate size, K = top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # the 128x128 weight / 1x128 activation scaling block


# ---- norms and RoPE -----------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (w * (x_f32 * rsqrt(mean(x_f32^2) + eps))).to(x.dtype); the weight stays fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * y).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split rotation. x [T, H, D]; cos/sin [T, D/2] already carry the YaRN mscale."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---- attention ------------------------------------------------------------------------------------
# Score elements (Hq x Tq x Tk) up to which a sequence is attended in one dense pass. Larger ones (a long
# prompt: 4 heads x 30k x 30k is 14 GB of fp32 scores per temporary) go in blocks of query rows, each
# against only the keys its rows can see (causal: up to the block's last position; a window: from the
# first row's oldest key), so memory stays bounded and a sliding layer costs O(T x W), not O(T^2). Same
# formula per row; the masked keys a block leaves out contribute exact zeros, so only the summation
# order (the last fp32 bit) can differ from one dense pass.
DENSE_SCORES = 1 << 22


def _block_rows(hq: int, tq: int, tk: int, window: int | None) -> int:
    """Query rows per block: about DENSE_SCORES score elements (keys per block: all Tk, or W + rows)."""
    if window is None:
        return max(16, DENSE_SCORES // (hq * tk))
    rows = 16
    while rows < tq and hq * (2 * rows) * (2 * rows + window) <= DENSE_SCORES:
        rows *= 2
    return rows


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                k_pos: torch.Tensor, sinks: torch.Tensor, sm_scale: float, window: int | None) -> torch.Tensor:
    """One sequence. q [Tq,Hq,D], k/v [Tk,Hkv,D], q_pos [Tq] and k_pos [Tk] absolute positions, both
    ascending. In blocks of query rows past DENSE_SCORES (see there), else `_attend_dense`."""
    tq, hq, tk = q.shape[0], q.shape[1], k.shape[0]
    if hq * tq * tk <= DENSE_SCORES:
        return _attend_dense(q, k, v, q_pos, k_pos, sinks, sm_scale, window)
    out = torch.empty_like(q)
    rows = _block_rows(hq, tq, tk, window)
    group = hq // k.shape[1]  # K/V per query head and in fp32 once, not per block
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    for i0 in range(0, tq, rows):
        i1 = min(tq, i0 + rows)
        hi = int(torch.searchsorted(k_pos, q_pos[i1 - 1], right=True))  # keys at or before the last row
        lo = 0 if window is None else int(torch.searchsorted(k_pos, q_pos[i0] - (window - 1)))
        out[i0:i1] = _attend_dense(q[i0:i1], k[lo:hi], v[lo:hi], q_pos[i0:i1], k_pos[lo:hi], sinks, sm_scale,
                                   window)
    return out


def _attend_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  k_pos: torch.Tensor, sinks: torch.Tensor, sm_scale: float, window: int | None) -> torch.Tensor:
    """`_attend_one` in one pass: the [Hq, Tq, Tk] scores at once.

    Sink: a per-head raw logit (never scaled) with no value vector, so each row sums to < 1.
    Window W keeps keys with q_pos - k_pos < W (the current token plus W-1 before it).
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf, kf, vf = q.float(), k.float(), v.float()
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)  # q head h uses KV head h // group
        vf = vf.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * sm_scale  # [Hq, Tq, Tk]
    diff = q_pos[:, None] - k_pos[None, :]  # [Tq, Tk]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    sink = sinks.float()[:, None, None].expand(hq, q.shape[0], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(q.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, sinks: torch.Tensor, sm_scale: float,
                     window: int | None) -> torch.Tensor:
    """Dense varlen causal attention, queries aligned to the END of each sequence's keys.

    q [T,Hq,D]; k/v [Tk,Hkv,D]; cu_seqlens_* [B+1]. Query i of a sequence with Lq queries and Lk
    keys sits at relative position Lk - Lq + i; keys at 0..Lk-1.
    """
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq == 0:
            continue
        q_pos = torch.arange(lk - lq, lk, device=q.device)
        k_pos = torch.arange(lk, device=q.device)
        out[cq[b]:cq[b + 1]] = _attend_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                                          q_pos, k_pos, sinks, sm_scale, window)
    return out


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x [T,Hkv,D] -> e4m3 with one scale per KV head (scale [Hkv] fp32; None = 1.0):
    RTNE(clamp(x / scale, +-448)). Exact division, like the store kernel's div_rn."""
    xf = x.float()
    if scale is not None:
        xf = xf / scale.float().to(x.device)[None, :, None]
    return xf.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows [N,Hkv,D] -> fp32 values: e4m3 codes times their head's scale; other dtypes as stored."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    xf = x.float()
    return xf if scale is None else xf * scale.float().to(x.device)[None, :, None]


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """cache [NP,Hkv,P,D] (HND), pages [n] logical order -> [num_tokens,Hkv,D]; FP8 caches come back
    dequantised to fp32 with `scale` [Hkv]."""
    np_, hkv, p, d = cache.shape
    sel = cache[pages.long()]  # [n,Hkv,P,D]
    return dequantize_kv(sel.permute(0, 2, 1, 3).reshape(-1, hkv, d)[:num_tokens], scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor,
                    sinks: torch.Tensor, sm_scale: float, window: int | None,
                    kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention whose keys all live in pages (the query tokens' own K/V already stored).

    q [T,Hq,D]; caches [NP,Hkv,P,D]; page_table [B,maxp] (logical order); kv_lens [B] tokens in
    each sequence's view. Queries are aligned to the end of the view, as in `varlen_attention`.
    FP8 caches are read through `kv_scale` = (k_scale, v_scale) [Hkv] (None = 1.0).
    """
    out = torch.empty_like(q)
    cq, lens = cu_seqlens_q.tolist(), kv_lens.tolist()
    p = k_cache.shape[2]
    ks, vs = kv_scale if kv_scale is not None else (None, None)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], lens[b]
        if lq == 0:
            continue
        n = (lk + p - 1) // p
        k = gather_pages(k_cache, page_table[b, :n], lk, ks)
        v = gather_pages(v_cache, page_table[b, :n], lk, vs)
        q_pos = torch.arange(lk - lq, lk, device=q.device)
        k_pos = torch.arange(lk, device=q.device)
        out[cq[b]:cq[b + 1]] = _attend_one(q[cq[b]:cq[b + 1]], k, v, q_pos, k_pos, sinks, sm_scale, window)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Scatter k/v [T,Hkv,D] into caches [NP,Hkv,P,D] at slot = page * P + offset; -1 skips. FP8
    caches get `quantize_kv` with kv_scale = (k_scale, v_scale) [Hkv] (None = 1.0)."""
    p = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, offs = slots // p, slots % p
    if k_cache.dtype == torch.float8_e4m3fn:
        ks, vs = kv_scale if kv_scale is not None else (None, None)
        k_cache[pages, :, offs] = quantize_kv(k[keep], ks)
        v_cache[pages, :, offs] = quantize_kv(v[keep], vs)
        return
    k_cache[pages, :, offs] = k[keep].to(k_cache.dtype)
    v_cache[pages, :, offs] = v[keep].to(v_cache.dtype)


# ---- MoE ------------------------------------------------------------------------------------------
def route(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (with bias) -> top-k (sorted desc) -> softmax over the k, in the logits dtype.

    Returns weights [T,K] and expert ids [T,K] (int64).
    """
    logits = F.linear(x, router_w, router_b)  # [T,E]
    vals, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(vals, dim=-1, dtype=vals.dtype), ids


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [...,2I] INTERLEAVED (even = gate, odd = up). Gate clamped from above only; note +1."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor,
        w2: torch.Tensor, b2: torch.Tensor | None, alpha: float, limit: float,
        expert_start: int = 0) -> torch.Tensor:
    """Experts for already-routed tokens. x [T,H]; weights/ids [T,K]; w1 [El,2I,H]; b1 [El,2I];
    w2 [El,H,I]; b2 [El,H] or None (a TP shard that must not add the bias twice).

    Only experts [expert_start, expert_start + El) are local; other (token, expert) pairs are
    skipped, so summing the outputs of all expert-parallel ranks gives the full MoE.
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    local = ids - expert_start
    for e in range(w1.shape[0]):
        tok, slot = torch.where(local == e)
        if tok.numel() == 0:
            continue
        h = F.linear(x[tok], w1[e], b1[e])
        a = swiglu(h, alpha, limit)
        y = F.linear(a, w2[e], None if b2 is None else b2[e])
        out.index_add_(0, tok, (y * weights[tok, slot, None]).float())
    return out.to(x.dtype)


# ---- FP8 block scaling ----------------------------------------------------------------------------
def quantize_fp8_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [...,N,K] -> (e4m3 [...,N,K], fp32 scale [...,ceil(N/b),ceil(K/b)]) with w ~= q * scale."""
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    tiles = pad.reshape(*lead, nb, block, kb, block)
    amax = tiles.abs().amax(dim=(-3, -1))  # [...,nb,kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return q, scale


def dequantize_fp8_blockwise(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M,K] -> (e4m3 [M,K], fp32 scale [M,ceil(K/group)]), one scale per 1x128."""
    m, k = x.shape
    kb = -(-k // group)
    pad = F.pad(x.float(), (0, kb * group - k)).reshape(m, kb, group)
    amax = pad.abs().amax(-1).clamp(min=1e-12)
    # Divide by a tensor, not the Python float: CUDA torch turns division by a scalar into a
    # multiplication by its reciprocal, 1 ulp off for some amax (seen on the H200), while the kernels
    # (and torch on CPU) divide exactly; then codes on a rounding boundary flip.
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (pad / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, kb * group)[:, :k].contiguous(), scale


def dequantize_fp8_per_token(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    m, k = q.shape
    kb = scale.shape[1]
    pad = F.pad(q.float(), (0, kb * group - k)).reshape(m, kb, group)
    return (pad * scale[..., None]).reshape(m, kb * group)[:, :k]


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               quantize_activations: bool = True) -> torch.Tensor:
    """y = x W^T + b with W in FP8 128x128 blocks; x optionally through 1x128 FP8 quantisation
    (what the GPU kernels do). Accumulates in fp32, returns x.dtype."""
    xf = dequantize_fp8_per_token(*quantize_fp8_per_token(x)) if quantize_activations else x.float()
    y = xf @ dequantize_fp8_blockwise(w_q, w_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
