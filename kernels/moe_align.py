"""MoE routing and token grouping in Triton: the two small kernels in front of the expert GEMMs.

  1. `route_topk_softmax`: router logits [T, E] -> top-k (sorted descending, lowest expert id on
     ties) -> softmax over the k selected logits, computed in fp32 and stored in the logits dtype
     (MODEL_SPEC §1.2: the softmax runs in the logits dtype, bf16 in the model). One fused kernel:
     torch would take topk + softmax + a dtype pass, i.e. three launches per layer at decode.
  2. `align_by_expert`: (token, slot) pairs -> rows grouped by local expert, each expert's group
     padded to a multiple of BLOCK_M, so one GEMM tile never mixes experts. Pairs routed to experts
     outside [expert_start, expert_start + El) (expert parallelism: another rank owns them) are
     dropped here; experts with no tokens get no tiles. One single-program kernel for decode-sized
     batches, four launches over many programs from PARALLEL_MIN_PAIRS pairs; no host sync: every
     buffer has a size bound known from T, so the step is CUDA-graph capturable.

Pair p = t * top_k + j names slot j of token t. Outputs of the grouping:
  sorted_pairs [max_blocks * BLOCK_M] int32  pair per row; padding rows hold num_pairs
  block_expert [max_blocks] int32            local expert of each row tile; -1 past the end
  num_rows     [1] int32                     rows in use (a multiple of BLOCK_M)
with max_blocks = ceil(P / BLOCK_M) + min(P, El) >= sum_e ceil(count_e / BLOCK_M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


# ---- top-k + softmax ----------------------------------------------------------------------------
@triton.jit
def _order_keys(x, cols, BLOCK_E: tl.constexpr):
    """fp32 [.., BE] -> int64 keys whose order is (value, then lower column): one max reduction
    picks the largest logit and, on ties, the lowest expert id."""
    b = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0, equal floats equal keys
    o = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits -> signed int order
    return (o.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)


@triton.jit
def _key_value_id(key, BLOCK_E: tl.constexpr):
    """The (fp32 value, column) a key of _order_keys came from."""
    o = (key >> 32).to(tl.int32)
    v = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return v, BLOCK_E - 1 - (key & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def topk_softmax_rows(logits_ptr, rows, rmask, E, stride_lt, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Top-k + softmax of logits rows [BT]: (expert ids [BT, BK] int32, weights [BT, BK] fp32);
    slots >= TOP_K are padding. One pass, one reduction per slot: each selection is a max over
    packed (value, -id) keys (the first is also the softmax shift); the exp sum runs in slot order."""
    cols = tl.arange(0, BLOCK_E)  # [BE]
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + cols[None, :],
                mask=rmask[:, None] & (cols < E)[None, :], other=float("-inf")).to(tl.float32)
    keys = _order_keys(x, cols[None, :], BLOCK_E)  # [BT, BE]
    slots = tl.arange(0, BLOCK_K)  # [BK] >= TOP_K, a power of two
    vals = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.int32)
    top = tl.zeros((rows.shape[0],), dtype=tl.float32)
    denom = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        k = tl.max(keys, axis=1)  # [BT]
        v, idx = _key_value_id(k, BLOCK_E)
        if j == 0:
            top = tl.where(rmask, v, 0.0)
        denom += tl.exp(v - top)
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)
        keys = tl.where(keys == k[:, None], -0x7FFFFFFFFFFFFFFF, keys)  # taken: below every real key
    return ids, tl.exp(vals - top[:, None]) / denom[:, None]


@triton.jit
def store_routes(ids_ptr, w_ptr, rows, ids, w, mask, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids / weights [BT, BK] of topk_softmax_rows -> [T, TOP_K] buffers, where mask [BT]."""
    slots = tl.arange(0, BLOCK_K)
    m = mask[:, None] & (slots < TOP_K)[None, :]
    offs = rows[:, None] * TOP_K + slots[None, :]
    tl.store(ids_ptr + offs, ids, mask=m)
    tl.store(w_ptr + offs, w.to(w_ptr.dtype.element_ty), mask=m)


@triton.jit
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, TOP_K: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    rmask = rows < T
    ids, w = topk_softmax_rows(logits_ptr, rows, rmask, E, stride_lt, TOP_K, BLOCK_E, BLOCK_K)
    store_routes(ids_ptr, w_ptr, rows, ids, w, rmask, TOP_K, BLOCK_K)


def route_topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, expert ids [T, k] int32)."""
    t, e = logits.shape
    assert 0 < top_k <= e
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t > 0:
        block_e = triton.next_power_of_2(e)
        block_t = max(1, min(16, 4096 // block_e))
        _topk_softmax_kernel[(triton.cdiv(t, block_t),)](logits, weights, ids, t, e, logits.stride(0),
                                                          TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e,
                                                          BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return weights, ids


# ---- grouping by expert -------------------------------------------------------------------------
@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, cnt_ptr, start_ptr, rank_ptr,
                  P, expert_start, num_local, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  TILE_CHUNK: tl.constexpr):
    """Single program. cnt/start [BLOCK_E] and rank [P] int32 are scratch."""
    e_off = tl.arange(0, BLOCK_E)
    c_off = tl.arange(0, CHUNK)
    tl.store(cnt_ptr + e_off, tl.zeros((BLOCK_E,), dtype=tl.int32))
    tl.debug_barrier()
    # 1. count per local expert; the atomic's old value is the pair's rank inside its expert.
    for p0 in range(0, P, CHUNK):
        p = p0 + c_off
        pm = p < P
        e = tl.load(ids_ptr + p, mask=pm, other=-1) - expert_start
        ok = pm & (e >= 0) & (e < num_local)
        r = tl.atomic_add(cnt_ptr + e, 1, mask=ok)
        tl.store(rank_ptr + p, r, mask=ok)
    tl.debug_barrier()
    # 2. padded segment starts (exclusive cumsum) and the expert of every row tile.
    cnt = tl.load(cnt_ptr + e_off, mask=e_off < num_local, other=0, volatile=True)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + e_off, ends - padded)
    total = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, total)
    for b0 in range(0, max_blocks, TILE_CHUNK):  # [TILE_CHUNK, BLOCK_E] compare: keep it small
        b = b0 + tl.arange(0, TILE_CHUNK)
        row = b * BLOCK_M
        # expert of tile b = number of experts whose padded segment ends at or before its first row
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row < total, owner, -1), mask=b < max_blocks)
    # 3. padding rows point past the last pair; then 4. scatter each pair to its row.
    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        r = r0 + c_off
        tl.store(sorted_ptr + r, tl.zeros((CHUNK,), dtype=tl.int32) + P, mask=r < max_blocks * BLOCK_M)
    tl.debug_barrier()
    for p0 in range(0, P, CHUNK):
        p = p0 + c_off
        pm = p < P
        e = tl.load(ids_ptr + p, mask=pm, other=-1) - expert_start
        ok = pm & (e >= 0) & (e < num_local)
        dest = tl.load(start_ptr + e, mask=ok, other=0, volatile=True) + \
            tl.load(rank_ptr + p, mask=ok, other=0, volatile=True)
        tl.store(sorted_ptr + dest, p, mask=ok)


# Prefill-sized groupings (thousands of pairs) run the same steps over many programs: the single
# program above serialises ~P / 1024 chunks and took ~109 us at 8k tokens x 4 (run DG4's profile).
PARALLEL_MIN_PAIRS = 4096


@triton.jit
def _count_kernel(ids_ptr, cnt_ptr, rank_ptr, P, expert_start, num_local, CHUNK: tl.constexpr):
    """Per pair: its rank inside its local expert (the atomic's old value); cnt zeroed by the host."""
    p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    pm = p < P
    e = tl.load(ids_ptr + p, mask=pm, other=-1) - expert_start
    ok = pm & (e >= 0) & (e < num_local)
    r = tl.atomic_add(cnt_ptr + e, 1, mask=ok)
    tl.store(rank_ptr + p, r, mask=ok)


@triton.jit
def _segments_kernel(cnt_ptr, start_ptr, block_expert_ptr, num_rows_ptr, num_local, max_blocks,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """Single program, O(E + tiles): padded segment starts, rows in use, expert of every tile."""
    e_off = tl.arange(0, BLOCK_E)
    cnt = tl.load(cnt_ptr + e_off, mask=e_off < num_local, other=0)
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(start_ptr + e_off, ends - padded)
    total = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, total)
    for b0 in range(0, max_blocks, TILE_CHUNK):
        b = b0 + tl.arange(0, TILE_CHUNK)
        row = b * BLOCK_M
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(row < total, owner, -1), mask=b < max_blocks)


@triton.jit
def _place_kernel(ids_ptr, sorted_ptr, block_expert_ptr, cnt_ptr, start_ptr, rank_ptr, P, expert_start,
                  num_local, n_rows, fill_programs, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Two disjoint roles, so no ordering between programs: the first `fill_programs` write P into
    every row that holds no pair (a segment's tail, unused tiles); the rest put each pair in its row."""
    pid = tl.program_id(0)
    off = tl.arange(0, CHUNK)
    if pid < fill_programs:
        r = pid * CHUNK + off
        rm = r < n_rows
        e = tl.load(block_expert_ptr + r // BLOCK_M, mask=rm, other=-1)
        used = (e >= 0) & ((r - tl.load(start_ptr + e, mask=e >= 0, other=0))
                           < tl.load(cnt_ptr + e, mask=e >= 0, other=0))
        tl.store(sorted_ptr + r, tl.zeros((CHUNK,), dtype=tl.int32) + P, mask=rm & ~used)
    else:
        p = (pid - fill_programs) * CHUNK + off
        pm = p < P
        e = tl.load(ids_ptr + p, mask=pm, other=-1) - expert_start
        ok = pm & (e >= 0) & (e < num_local)
        dest = tl.load(start_ptr + e, mask=ok, other=0) + tl.load(rank_ptr + p, mask=ok, other=0)
        tl.store(sorted_ptr + dest, p, mask=ok)


@dataclass(slots=True)
class ExpertGrouping:
    sorted_pairs: torch.Tensor  # [max_blocks * BLOCK_M] int32, padding = num_pairs
    block_expert: torch.Tensor  # [max_blocks] int32, local expert id, -1 = unused tile
    num_rows: torch.Tensor  # [1] int32
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_row_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    return triton.cdiv(num_pairs, block_m) + min(num_pairs, num_local)


def align_by_expert(ids: torch.Tensor, expert_start: int, num_local: int, block_m: int
                    ) -> ExpertGrouping:
    """ids [T, k] global expert ids -> rows grouped by local expert (see module docstring)."""
    p = ids.numel()
    dev = ids.device
    ids = ids.reshape(-1).to(torch.int32)
    max_blocks = max(1, max_row_blocks(p, num_local, block_m))
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_rows = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(max(num_local, 2))
    scratch = torch.empty(2 * block_e + max(p, 1), dtype=torch.int32, device=dev)
    cnt, start, rank = scratch[:block_e], scratch[block_e:2 * block_e], scratch[2 * block_e:]
    if p < PARALLEL_MIN_PAIRS:
        _align_kernel[(1,)](ids, sorted_pairs, block_expert, num_rows, cnt, start, rank,
                            p, expert_start, num_local, max_blocks,
                            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=1024, TILE_CHUNK=64, num_warps=8)
    else:  # memset + three launches over many programs (same outputs up to row order within an expert)
        chunk = 1024
        cnt.zero_()
        _count_kernel[(triton.cdiv(p, chunk),)](ids, cnt, rank, p, expert_start, num_local, CHUNK=chunk,
                                                num_warps=4)
        _segments_kernel[(1,)](cnt, start, block_expert, num_rows, num_local, max_blocks, BLOCK_M=block_m,
                               BLOCK_E=block_e, TILE_CHUNK=64, num_warps=4)
        n_rows = max_blocks * block_m
        fill = triton.cdiv(n_rows, chunk)
        _place_kernel[(fill + triton.cdiv(p, chunk),)](ids, sorted_pairs, block_expert, cnt, start, rank, p,
                                                       expert_start, num_local, n_rows, fill,
                                                       BLOCK_M=block_m, CHUNK=chunk, num_warps=4)
    return ExpertGrouping(sorted_pairs, block_expert, num_rows, block_m, p)
