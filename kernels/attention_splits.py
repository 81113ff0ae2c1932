"""Split-KV for the sink attention kernel (kernels/triton_attention.py `_attn_fwd`): partial buffers, the
merges, and the graphs' per-sequence split policy.

Eager launches (TritonAttention, triton_decode) split every sequence of a launch alike (`num_splits`) and merge
per (token, head) with `_merge_splits`. A CUDA graph cannot pick a split count per step, so the graphed attention
(kernels/triton_graph_attention.py) launches a fixed grid of `cap` splits and reads each sequence's count from row 5
of its seq_info, which `split_counts` fills per step on the host: a sequence at 100k context among short ones gets
`cap` programs per KV head instead of one (one program streaming 25 MB would hold the step for ~0.5 ms per full
layer), and a sequence that needs one split has split 0 write its output directly while splits >= its count return
at once; `_merge_tile_splits` then walks the launch's tiles and merges only the sequences that split.
Merging is associative over (m, l, acc) with split 0 carrying the sink, so the result equals the unsplit kernel up
to fp32 rounding of the combination order.

Shapes: S splits, T tokens (or tiles, for one-token tables), Hq query heads, D head dim.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _merge_splits(PartAcc, PartM, PartL, Out, num_tokens, num_q_heads, num_splits, stride_ot, stride_oh,
                  BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (token, q head): BLOCK_S splits per iteration, combined by a running max, so a
    batch-1 decode with 64 splits merges in one vector step per head (a loop over splits per program
    was latency-bound: 33 us per full layer at batch 1 on the H200, decode-profile-1)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([1], float("-inf"), tl.float32)
    l_tot = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ok = s < num_splits
        idx = (s * num_tokens + t) * num_q_heads + h  # [S]
        pm = tl.load(PartM + idx, mask=ok, other=float("-inf"))
        # Split 0 (in the first block) carries the sink, so m_new is finite; empty splits weigh 0.
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(pm - m_new)  # [S]
        l_tot = l_tot * alpha + tl.sum(w * tl.load(PartL + idx, mask=ok, other=0.0), axis=0)
        part = tl.load(PartAcc + idx[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)  # [S, D]
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m = m_new
    tl.store(Out + t * stride_ot + h * stride_oh + d, (acc / l_tot).to(Out.dtype.element_ty))



def split_partials(splits: int, out: torch.Tensor, rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split-KV partials for out [T, Hq, D]: (acc [S, R, Hq, D], m [S, R, Hq], l [S, R, Hq]) fp32 with R = rows (an
    ADAPTIVE launch's tiles, for one-token tables) or T, or out itself three times when there is one split (the
    kernels then write out directly)."""
    if splits <= 1:
        return out, out, out
    hq, d = out.shape[1], out.shape[2]
    r = out.shape[0] if rows is None else rows
    part_m = torch.empty(splits, r, hq, dtype=torch.float32, device=out.device)
    return torch.empty(splits, r, hq, d, dtype=torch.float32, device=out.device), part_m, torch.empty_like(part_m)


def merge_splits(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor) -> None:
    """out [T, Hq, D] <- the split-KV partials of `split_partials`."""
    splits, t, hq, d = part_acc.shape
    _merge_splits[(t, hq)](part_acc, part_m, part_l, out, t, hq, splits, out.stride(0), out.stride(1),
                           BLOCK_S=min(64, triton.next_power_of_2(splits)), HEAD_DIM=d, num_warps=2)


@triton.jit
def _merge_tile_splits(PartAcc, PartM, PartL, Out, SeqInfo, Tiles, num_seqs, num_tiles, num_tokens, num_q_heads,
                       num_splits, stride_ot, stride_oh, GROUP: tl.constexpr, HPP: tl.constexpr,
                       BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, PART_BY_TILE: tl.constexpr):
    """One program per (tile, head group) of an ADAPTIVE `_attn_fwd` launch, on the same tables: its rows'
    partials over the sequence's splits (seq_info row 5), combined by a running max; tiles of sequences in
    one split (written by split 0 already) and padded tiles (the empty sequence, q_len 0) store nothing."""
    SUBG: tl.constexpr = GROUP // HPP
    tile = tl.program_id(0)
    kvh = tl.program_id(1) // SUBG
    h0 = kvh * GROUP + (tl.program_id(1) % SUBG) * HPP
    b = tl.load(Tiles + tile)
    used = tl.minimum(tl.maximum(tl.load(SeqInfo + 5 * num_seqs + b), 1), num_splits)
    if used <= 1:  # one split (split 0 wrote the rows) or a padded tile
        return
    tok0 = tl.load(Tiles + num_tiles + tile)
    q_start = tl.load(SeqInfo + b)
    q_len = tl.load(SeqInfo + num_seqs + b)
    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // HPP  # [M]
    head = h0 + rows % HPP  # [M]
    ok = (tok < q_len) & (rows * 0 + used > 1)  # [M] operands: the CPU interpreter rejects bool scalars
    q_row = (q_start + tok).to(tl.int64)
    if PART_BY_TILE:
        prow = tile + rows * 0
        nrows = num_tiles
    else:
        prow = q_row
        nrows = num_tokens
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_tot = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for s in range(0, used):
        idx = (s * nrows + prow) * num_q_heads + head  # [M]
        pm = tl.load(PartM + idx, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, pm)  # split 0 carries the sink: finite for real rows from s = 0 on
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m - m_safe)
        w = tl.math.exp2(pm - m_safe)  # a row with no key in split s (m = -inf) weighs 0
        l_tot = l_tot * alpha + w * tl.load(PartL + idx, mask=ok, other=0.0)
        part = tl.load(PartAcc + idx[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)  # [M, D]
        acc = acc * alpha[:, None] + w[:, None] * part
        m = m_new
    out = acc / tl.where(l_tot == 0.0, 1.0, l_tot)[:, None]
    tl.store(Out + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=ok[:, None])


def split_counts(kv_lens: np.ndarray, tiles: np.ndarray, head_groups: int, cap: int, target: int,
                 min_keys: int) -> np.ndarray:
    """Splits per sequence [B] int32 for one launch (a pure function of the step): the launch's key work
    (each tile reads up to its sequence's kv_len keys, per head group) spread over about `target` programs
    gives a piece size of at least `min_keys`; each sequence splits its keys into pieces of that size, 1..cap.
    Many sequences at a modest context need no split (the grid already fills the GPU); a long one among them,
    or a few at long context, split until the grid is balanced."""
    kv = np.asarray(kv_lens, dtype=np.int64)
    n = np.ones(kv.shape, dtype=np.int32)
    if cap <= 1 or kv.size == 0:
        return n
    work = int((kv * np.asarray(tiles, dtype=np.int64)).sum()) * head_groups
    piece = max(min_keys, -(-work // max(target, 1)))
    return np.clip(-(-kv // piece), 1, cap).astype(np.int32)


def merge_tile_splits(parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out: torch.Tensor,
                      seq_info: torch.Tensor, tiles: torch.Tensor, head_groups: int, group: int, hpp: int,
                      block_m: int, by_tile: bool) -> None:
    """out [T, Hq, D] <- the rows of an ADAPTIVE launch whose sequences split (`_merge_tile_splits`)."""
    part_acc, part_m, part_l = parts
    splits, rows = part_acc.shape[0], part_acc.shape[1]
    num_tiles = tiles.shape[1]
    _merge_tile_splits[(num_tiles, head_groups)](
        part_acc, part_m, part_l, out, seq_info, tiles, seq_info.shape[1], num_tiles, rows, out.shape[1], splits,
        out.stride(0), out.stride(1), GROUP=group, HPP=hpp, BLOCK_M=block_m, HEAD_DIM=out.shape[2],
        PART_BY_TILE=by_tile, num_warps=4)
