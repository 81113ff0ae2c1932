"""Sink-aware flash attention in Triton (MODEL_SPEC.md §1.2): one kernel for varlen causal prefill,
chunked prefill and batched decode, plus a merge kernel for split-KV.

Role: the compute core of `TritonAttention` (kernels/triton_attention_backend.py). Lifecycle: the
backend builds an `AttnBatch` once per step (per page group), then every layer calls
`sink_attention`, which picks a launch config, launches `_attn_fwd` and, when the KV range is
split across programs, `_merge_splits` (kernels/attention_splits.py).

Keys of sequence b are indexed 0..kv_len-1 in its view: the first `paged_len` live in pages (HND
caches [NP, Hkv, P, D] read through `page_table[b]`), the rest are dense rows of k/v starting at
row `dense_start`. Queries are aligned to the end of the keys (query i of Lq sits at key index
kv_len - Lq + i). This covers every case of the backend: no cache (paged_len 0), everything in
pages (decode, full layers) and prefix-in-pages + new-tokens-dense (sliding-layer prefill chunks).

Math: a program owns BLOCK_M rows = (token, head) pairs of one sequence and one KV head (HPP
heads of the GQA group packed per token, so a K/V block is loaded once for all of them), and runs
an online softmax in the log2 domain. The running max starts at the sink logit (fp32, never
scaled) with l = 1, which is exactly adding exp(sink) to the denominator with no value vector.
With split-KV only split 0 starts from the sink; the others start empty (m = -inf, l = 0) and
`_merge_splits` combines the partial (m, l, acc). KV blocks outside the causal / sliding band are
never visited; blocks fully inside it run without masks.

FP8 (e4m3) pages: the paged range loads e4m3 tiles and widens them to q's dtype in registers (exact:
e4m3 fits bf16); the program's KV head has one K and one V scale, so K's is folded into the QK
multiplier and V's into the softmax weights of the PV product (l is summed before it). Dense keys
(the step's own K/V) are never quantised.

Shape legend: T query tokens (packed), B sequences, Hq / Hkv heads, G = Hq / Hkv, D head dim,
P page size, NP pages, S splits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels.attention_splits import merge_splits, split_partials

LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(acc, m_i, l_i, q, q_pos, j0, end, window, k_base, v_base, pt_row, dense_row0,
                  stride_k, stride_v, stride_cp, stride_ct, qk_scale, v_scale,
                  PAGED: tl.constexpr, MASK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  DOT_PREC: tl.constexpr, DEQUANT: tl.constexpr):
    j = j0 + tl.arange(0, BLOCK_N)  # [N] key indices in the view
    d = tl.arange(0, HEAD_DIM)
    if PAGED:
        if MASK:
            page = tl.load(pt_row + j // PAGE, mask=j < end, other=0)
        else:
            page = tl.load(pt_row + j // PAGE)
        k_off = page.to(tl.int64) * stride_cp + (j % PAGE).to(tl.int64) * stride_ct  # K, V share strides
        v_off = k_off
    else:
        row = (dense_row0 + j).to(tl.int64)
        k_off = row * stride_k
        v_off = row * stride_v
    if MASK:
        k = tl.load(k_base + k_off[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)  # [N, D]
        v = tl.load(v_base + v_off[:, None] + d[None, :], mask=(j < end)[:, None], other=0.0)
    else:
        k = tl.load(k_base + k_off[:, None] + d[None, :])
        v = tl.load(v_base + v_off[:, None] + d[None, :])
    if DEQUANT:  # e4m3 codes -> q's dtype (exact); the scales are applied to qk and p below
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N], log2 domain (x k_scale)
    if MASK:
        ok = (j[None, :] < end) & (j[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & ((q_pos[:, None] - j[None, :]) < window)
        qk = tl.where(ok, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row can still be empty in a split other than the first (m = -inf): keep exp2 finite.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DEQUANT:
        p = p * v_scale
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, q_pos, start, end, int_lo, int_hi, window, k_base, v_base, pt_row,
                  dense_row0, stride_k, stride_v, stride_cp, stride_ct, qk_scale, v_scale,
                  PAGED: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DEQUANT: tl.constexpr):
    """Keys [start, end) of one source: masked blocks up to the interior [int_lo, int_hi) (keys every
    row of the tile may see), unmasked full blocks inside it, masked blocks after it."""
    il = tl.maximum(int_lo, start)
    ih = tl.minimum(int_hi, end)
    has_int = ih > il
    pre_end = tl.where(has_int, il, end)
    n_pre = tl.cdiv(tl.maximum(pre_end - start, 0), BLOCK_N)
    u0 = start + n_pre * BLOCK_N
    n_mid = tl.where(has_int, tl.maximum(ih - u0, 0) // BLOCK_N, 0)
    t0 = u0 + n_mid * BLOCK_N
    n_tail = tl.cdiv(tl.maximum(end - t0, 0), BLOCK_N)
    for i in range(0, n_pre):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, start + i * BLOCK_N, end, window, k_base, v_base,
                                      pt_row, dense_row0, stride_k, stride_v, stride_cp, stride_ct, qk_scale, v_scale,
                                      PAGED, True, HAS_WINDOW, BLOCK_N, HEAD_DIM, PAGE, DOT_PREC, DEQUANT)
    for i in range(0, n_mid):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, u0 + i * BLOCK_N, end, window, k_base, v_base,
                                      pt_row, dense_row0, stride_k, stride_v, stride_cp, stride_ct, qk_scale, v_scale,
                                      PAGED, False, HAS_WINDOW, BLOCK_N, HEAD_DIM, PAGE, DOT_PREC, DEQUANT)
    for i in range(0, n_tail):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, q_pos, t0 + i * BLOCK_N, end, window, k_base, v_base,
                                      pt_row, dense_row0, stride_k, stride_v, stride_cp, stride_ct, qk_scale, v_scale,
                                      PAGED, True, HAS_WINDOW, BLOCK_N, HEAD_DIM, PAGE, DOT_PREC, DEQUANT)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd(Q, K, V, KC, VC, PT, Sinks, Out, PartAcc, PartM, PartL, SeqInfo, Tiles, KScale, VScale,
              num_seqs, num_tiles, num_tokens, num_q_heads, num_splits, qk_scale, window,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_cp, stride_ch, stride_ct, stride_pt, stride_ot, stride_oh,
              GROUP: tl.constexpr, HPP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
              DOT_PREC: tl.constexpr, KV_WIDEN: tl.constexpr, ADAPTIVE: tl.constexpr, PART_BY_TILE: tl.constexpr):
    TPT: tl.constexpr = BLOCK_M // HPP  # tokens per tile
    SUBG: tl.constexpr = GROUP // HPP  # programs per KV head
    tile = tl.program_id(0)
    kvh = tl.program_id(1) // SUBG
    h0 = kvh * GROUP + (tl.program_id(1) % SUBG) * HPP
    split = tl.program_id(2)
    b = tl.load(Tiles + tile)
    if SPLIT:
        if ADAPTIVE:  # graphs: the step's tables give each sequence's split count (attention_splits.py)
            used = tl.minimum(tl.maximum(tl.load(SeqInfo + 5 * num_seqs + b), 1), num_splits)
            if split >= used:  # a split past this sequence's count has no keys: out before loading anything else
                return
        else:
            used = num_splits
    tok0 = tl.load(Tiles + num_tiles + tile)
    q_start = tl.load(SeqInfo + b)
    q_len = tl.load(SeqInfo + num_seqs + b)
    paged_len = tl.load(SeqInfo + 2 * num_seqs + b)
    kv_len = tl.load(SeqInfo + 3 * num_seqs + b)
    dense_start = tl.load(SeqInfo + 4 * num_seqs + b)

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // HPP  # [M] token within the sequence's new tokens
    head = h0 + rows % HPP  # [M] q head
    row_ok = tok < q_len
    q_pos = kv_len - q_len + tok  # [M] query position in key coordinates
    d = tl.arange(0, HEAD_DIM)
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)  # [M, D]

    # Keys this tile needs: [lo, hi); keys every row sees without a mask: [int_lo, int_hi).
    qp_lo = kv_len - q_len + tok0
    qp_hi = tl.minimum(qp_lo + TPT, kv_len) - 1
    hi = qp_hi + 1
    int_hi = qp_lo + 1
    if HAS_WINDOW:
        lo = tl.maximum(qp_lo - window + 1, 0)
        int_lo = qp_hi - window + 1
    else:
        lo = qp_lo * 0
        int_lo = lo
    if SPLIT:
        chunk = tl.cdiv(tl.cdiv(hi - lo, used), BLOCK_N) * BLOCK_N
        s_lo = tl.minimum(lo + split * chunk, hi)
        s_hi = tl.minimum(s_lo + chunk, hi)
    else:
        s_lo = lo
        s_hi = hi

    # The sink enters split 0 only: m starts at the raw sink logit (log2 domain) with l = 1.
    sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
    first = split == 0
    m_i = tl.where(first, sink, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    kv_off = kvh.to(tl.int64) * stride_ch
    pt_row = PT + b.to(tl.int64) * stride_pt
    if KV_WIDEN:  # pages in another dtype (e4m3): this KV head's scales, K's into the QK multiplier, V's into p
        paged_qk_scale = qk_scale * tl.load(KScale + kvh)
        v_scale = tl.load(VScale + kvh)
    else:
        paged_qk_scale = qk_scale
        v_scale = 1.0
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, q_pos, s_lo, tl.minimum(s_hi, paged_len), int_lo, int_hi,
                                  window, KC + kv_off, VC + kv_off, pt_row, 0, 0, 0, stride_cp, stride_ct,
                                  paged_qk_scale, v_scale, True, HAS_WINDOW, BLOCK_N, HEAD_DIM, PAGE, DOT_PREC,
                                  KV_WIDEN)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, q_pos, tl.maximum(s_lo, paged_len), s_hi, int_lo, int_hi,
                                  window, K + kvh.to(tl.int64) * stride_kh, V + kvh.to(tl.int64) * stride_vh,
                                  pt_row, dense_start - paged_len, stride_kt, stride_vt, stride_cp, stride_ct,
                                  qk_scale, 1.0, False, HAS_WINDOW, BLOCK_N, HEAD_DIM, PAGE, DOT_PREC, False)

    if SPLIT:
        part_ok = row_ok
        if ADAPTIVE:  # a sequence in one split: split 0 writes out itself, the merge skips its tiles
            used_m = rows * 0 + used  # [M]: masks from [M] operands (the CPU interpreter rejects bool scalars)
            part_ok = row_ok & (used_m > 1)  # (splits >= used returned at the start)
            out_ok = row_ok & (used_m + split == 1)  # used == 1 and split == 0 (used >= 1, split >= 0)
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=out_ok[:, None])
        if PART_BY_TILE:  # one-token tiles: partial rows by tile (a table of max_seqs rows, not the bucket's)
            idx = (split * num_tiles + tile + rows * 0) * num_q_heads + head  # [M]
        else:
            idx = (split * num_tokens + q_row) * num_q_heads + head  # [M]
        tl.store(PartM + idx, m_i, mask=part_ok)
        tl.store(PartL + idx, l_i, mask=part_ok)
        tl.store(PartAcc + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=part_ok[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])


# ---- host side ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelConfig:
    block_m: int  # rows per program = tokens per tile x heads packed per token
    block_n: int  # keys per inner step
    heads_per_program: int  # HPP: q heads of one GQA group sharing each K/V load
    num_warps: int = 4
    num_stages: int = 2


@dataclass(slots=True)
class AttnBatch:
    """Per-step, per-layout sequence table (built once per step, reused by every layer).

    seq_info [5, B] int32 rows: q_start, q_len, paged_len, kv_len, dense_start.
    """

    seq_info: torch.Tensor
    page_table: torch.Tensor | None  # [B, maxp] int32 in logical order
    q_lens: list[int]
    kv_lens: list[int]
    _tiles: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, q_lens: list[int], paged_lens: list[int], kv_lens: list[int], page_table: torch.Tensor | None,
              device: torch.device | str) -> AttnBatch:
        q_start, acc = [], 0
        for n in q_lens:
            q_start.append(acc)
            acc += n
        # Dense keys of a sequence are its new tokens: they start where its queries start.
        rows = [q_start, list(q_lens), list(paged_lens), list(kv_lens), q_start]
        info = _upload(torch.tensor(rows, dtype=torch.int32), device)
        return cls(info, page_table, list(q_lens), list(kv_lens))

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    def tiles(self, tokens_per_tile: int) -> torch.Tensor:
        """[2, NT] int32: (sequence, first token) of every q tile; a sequence's last tiles (the
        most keys) come first so the long programs start early."""
        t = self._tiles.get(tokens_per_tile)
        if t is None:
            seq, tok = [], []
            for b, n in enumerate(self.q_lens):
                nt = -(-n // tokens_per_tile)
                seq += [b] * nt
                tok += [(nt - 1 - i) * tokens_per_tile for i in range(nt)]
            t = _upload(torch.tensor([seq, tok], dtype=torch.int32).reshape(2, -1), self.seq_info.device)
            self._tiles[tokens_per_tile] = t
        return t


def _upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Through pinned memory on CUDA: a pageable source may make the copy wait for the stream."""
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while n % (p * 2) == 0 and p * 2 <= cap:
        p *= 2
    return p


def pick_config(group: int, max_q_len: int, device: torch.device) -> KernelConfig:
    """Launch shape by step kind. Decode (q_len 1): the G heads of a group fill the M tile (16 rows
    minimum for tl.dot). Prefill: 128 rows = 16 tokens x 8 heads for gpt-oss, which also keeps the
    sliding band narrow (a 16-token tile needs 143 keys, a 128-token tile 255)."""
    hpp = _pow2_divisor(group, 16)
    if device.type != "cuda":  # the CPU interpreter: its cost is per program and per op, so few big tiles
        return KernelConfig(min(128, max(16, hpp * 16)), 32, hpp)
    if max_q_len <= 1:
        return KernelConfig(max(16, hpp), 64, hpp, num_warps=4, num_stages=3)
    return KernelConfig(128, 64, hpp, num_warps=8, num_stages=3)


def pick_num_splits(batch: AttnBatch, num_programs: int, window: int | None, cfg: KernelConfig,
                    target_programs: int) -> int:
    """Split the KV range only when the grid would leave SMs idle, and keep >= 2 blocks per split."""
    if num_programs >= target_programs:
        return 1
    keys = max(batch.kv_lens, default=0)
    if window is not None:
        keys = min(keys, window + cfg.block_m // cfg.heads_per_program)
    useful = max(1, keys // (2 * cfg.block_n))
    return max(1, min(-(-target_programs // num_programs), useful, 64))


def page_scales(kv_scale: tuple[torch.Tensor, torch.Tensor] | None, hkv: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) [Hkv] fp32 of e4m3 pages; None = 1.0 for every head."""
    if kv_scale is None:
        kv_scale = (torch.ones(hkv, dtype=torch.float32, device=device),) * 2
    ks, vs = kv_scale
    assert ks.dtype == vs.dtype == torch.float32 and ks.shape == vs.shape == (hkv,)
    return ks, vs


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor] | None, batch: AttnBatch, sinks: torch.Tensor,
                   sm_scale: float, window: int | None, *, config: KernelConfig | None = None,
                   num_splits: int | None = None, target_programs: int = 264,
                   out: torch.Tensor | None = None,
                   kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [T, Hq, D]; k/v [T, Hkv, D] dense keys (any row/head strides, last dim contiguous);
    kv_cache (k_cache, v_cache) [NP, Hkv, P, D] or None; sinks [Hq] fp32 raw logits. e4m3 caches
    are read through kv_scale = (k_scale, v_scale) [Hkv] fp32 (None = 1.0).
    Returns [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0 and d >= 16 and d & (d - 1) == 0, "head_dim must be a power of two >= 16"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    group = hq // hkv
    cfg = config or pick_config(group, batch.max_q_len, q.device)
    assert group % cfg.heads_per_program == 0 and cfg.block_m % cfg.heads_per_program == 0
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    widen = False  # pages in another dtype than q (e4m3, or bf16 under an fp32 model): widened in registers
    ks = vs = sinks  # any fp32 pointer where unused
    if kv_cache is not None:
        kc, vc = kv_cache
        assert kc.stride() == vc.stride() and kc.stride(3) == 1 and batch.page_table is not None
        assert vc.dtype == kc.dtype
        page, pt = kc.shape[2], batch.page_table
        widen = kc.dtype != q.dtype
        if widen:
            # scales only mean something for e4m3 (bf16 pages under an fp32 model widen at 1.0)
            ks, vs = page_scales(kv_scale if kc.dtype == torch.float8_e4m3fn else None, hkv, q.device)
    else:  # no pages: the paged range is empty, any valid pointers do
        kc, vc, page, pt = k, v, 16, batch.seq_info
    tiles = batch.tiles(cfg.block_m // cfg.heads_per_program)
    num_tiles = tiles.shape[1]
    hgroups = hkv * (group // cfg.heads_per_program)
    splits = num_splits or pick_num_splits(batch, num_tiles * hgroups, window, cfg, target_programs)
    part_acc, part_m, part_l = split_partials(splits, out)
    _attn_fwd[(num_tiles, hgroups, splits)](
        q, k, v, kc, vc, pt, sinks, out, part_acc, part_m, part_l, batch.seq_info, tiles, ks, vs,
        batch.num_seqs, num_tiles, t, hq, splits, sm_scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), pt.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HPP=cfg.heads_per_program, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d,
        PAGE=page, SPLIT=splits > 1, HAS_WINDOW=window is not None,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", KV_WIDEN=widen, ADAPTIVE=False,
        PART_BY_TILE=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        merge_splits(part_acc, part_m, part_l, out)
    return out
