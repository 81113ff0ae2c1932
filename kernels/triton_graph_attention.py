"""Attention a CUDA graph can hold: the sink-aware Triton kernel (kernels/triton_attention.py `_attn_fwd`) on
tables of fixed capacity, so a step's attention can be captured inside the piecewise graphs
(engine/piecewise.py, --piecewise-graphed-attention sliding|all) instead of running as eager islands between
them; with `all` a step up to the largest bucket is one graph.

Why: a served mixed step (a new turn's ~300 tokens joining ~60 decoding sequences) was host-bound: its
launch took 18.2 ms of CPU against 12.5 ms of GPU (multi-turn-colocated-pw-11's step trace, p50), and about
half of a launch was the 24 attention islands' Python (cProfile in mixed-step-6: 10 of 21 ms; each: RoPE,
the gather of [ring prefix ; new keys] or the store, the FlashInfer call, allocations). The generic kernel
read decode rows at 90 % of copy bandwidth (batch 64 x 8k, 2026-11-30/kernels_attention.json; FlashInfer fa2
94.6 %) but ran long-prompt prefill at half fa3's rate (220 vs 430 TFLOP/s at 8k): a fit for mixed steps
(decode rows plus a few hundred new tokens), not for long chunks. Sliding layers read at most W + 15 keys per
query, straight from the ring pages and the new dense keys.

What varies per step lives in device buffers the graph reads, filled before each replay (`GroupTables.fill`),
one set per page group:
  seq_info [5, S + 1] int32   q_start, q_len, paged_len, kv_len, dense_start per sequence; column S is an
                               empty sequence (q_len 0) that padded tiles point at
  page_table [S + 1, R] int32  each sequence's view as the step's GroupMeta has it (R: the ring's pages for
                               sliding layers, max_model_len / P for full ones)
  tiles [2, NT(b)] int32 x 2   (sequence, first token) per q tile: one-token rows (a mixed step's decode rows)
                               in decode-shaped tiles (one token's G heads, NT = min(b, S)), chunks in
                               prefill-shaped ones (TPT = 16 tokens x G heads, NT = b // TPT + 1 + min(b, S)),
                               each table launched on its own fixed grid (a decode row in a 128-row tile would
                               do 16 tokens' MMA work for one)
  slots_pre, slots_post [b]    where each new token is stored before / after the read (int64, -1: not
                               stored: padded rows, the ring's skipped head, and every row of the other one)
  seq_info row 5               full layers: each sequence's split-KV count (kernels/attention_splits.py)
Each launch's grid is (NT(b), KV-head groups, cap): sliding layers never split (cap 1: a window's keys are few);
full layers launch `cap` splits per tile (GroupTables.splits, per table) and each sequence uses the count its
seq_info says, so a decode row at 100k context is read by up to cap programs per KV head as FlashInfer's split-KV
would, with a merge launch after; nothing in a launch's shape depends on the step.
Both orders of the eager backends are in the graph and the tables pick one per step: full layers, and a
sliding step whose ring holds the window and its new tokens, store first and read every key through the
pages (paged_len = kv_len); a chunk larger than the ring reads its prefix from the pages and its own keys
densely, then stores (paged_len = prefix), as TritonAttention and FlashInferAttention do. Per-row math is
`_attn_fwd`'s with TritonAttention's tile partition (tokens [i*TPT, (i+1)*TPT) of each sequence), so on the
CPU interpreter the pieces match the eager Triton backend bit for bit (tests/integration/test_piecewise.py).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.attention_splits import merge_tile_splits, split_counts, split_partials
from kernels.interface import GroupMeta, StepMeta
from kernels.triton_attention import LOG2E, KernelConfig, _attn_fwd, page_scales, pick_config

# full layers on a GPU: split caps of the (one-token rows, chunks) launches, and the smallest piece of keys worth a
# program of its own (below it the partials' traffic and the merge cost more than the balance gains)
GPU_SPLITS = (16, 4)
MIN_SPLIT_KEYS = 1024


def tiles_capacity(bucket: int, tokens_per_tile: int, max_seqs: int) -> int:
    """Tiles any step of <= bucket tokens over <= max_seqs sequences needs (each adds one partial tile)."""
    return bucket // tokens_per_tile + 1 + min(bucket, max_seqs)


class GroupTables:
    """One page group's per-step tables at fixed addresses, two tile tables (decode, chunk) per bucket."""

    def __init__(self, buckets: tuple[int, ...], max_seqs: int, max_pages: int, group: int, device: torch.device,
                 configs: tuple[KernelConfig, KernelConfig], *, splits: tuple[int, int] = (1, 1),
                 head_groups: tuple[int, int] = (1, 1), target_programs: int = 264,
                 min_split_keys: int = MIN_SPLIT_KEYS) -> None:
        """splits: split-KV caps of the (one-token, chunk) launches (1: never split; sliding groups);
        head_groups: each launch's programs per tile, for the split policy."""
        self.max_seqs, self.max_pages, self.group = max_seqs, max_pages, group
        self.configs = configs  # (one-token rows, chunks)
        self.tpt = tuple(c.block_m // c.heads_per_program for c in configs)  # tokens per tile
        self.splits, self.head_groups = splits, head_groups
        self.target_programs, self.min_split_keys = target_programs, min_split_keys
        s = max_seqs + 1  # column max_seqs: the empty sequence padded tiles point at
        self.seq_info = torch.zeros(6, s, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(s, max_pages, dtype=torch.int32, device=device)
        self.slots_pre = torch.full((max(buckets),), -1, dtype=torch.int64, device=device)
        self.slots_post = torch.full((max(buckets),), -1, dtype=torch.int64, device=device)
        caps = (lambda b: min(b, max_seqs), lambda b: tiles_capacity(b, self.tpt[1], max_seqs))
        # every tile starts out empty (sequence max_seqs)
        self.tiles = {b: tuple(torch.stack([torch.full((cap(b),), max_seqs, dtype=torch.int32),
                                            torch.zeros(cap(b), dtype=torch.int32)]).to(device) for cap in caps)
                      for b in buckets}

    def fill(self, step: StepMeta, bucket: int) -> None:
        """This step's tables (host work and a few small copies, before the graph replays)."""
        g: GroupMeta = step.groups[self.group]
        assert g is not None, "a step without pages runs the eager forward"
        q = np.asarray(step.q_lens_host, dtype=np.int64)
        n, t = len(q), int(q.sum())
        assert n <= self.max_seqs and t <= bucket, (n, t, bucket)
        q_start = np.zeros(n, dtype=np.int64)
        np.cumsum(q[:-1], out=q_start[1:])
        info = np.zeros((6, self.max_seqs + 1), dtype=np.int32)
        info[0, :n] = q_start
        info[1, :n] = q
        # store first and read every key from the pages, or (a sliding chunk past the ring) the prefix from the
        # pages and the rest dense
        info[2, :n] = g.kv_lens_host if g.pages_hold_all else g.prefix_lens_host
        info[3, :n] = g.kv_lens_host
        info[4, :n] = q_start
        info[5, :] = 1
        one = q == 1
        row_sets = (np.flatnonzero(one), np.flatnonzero(~one))  # the one-token table's sequences, the chunks'
        kv = np.asarray(g.kv_lens_host, dtype=np.int64)
        for rows, tpt, cap, hg in zip(row_sets, self.tpt, self.splits, self.head_groups):
            if cap > 1 and rows.size:
                info[5, rows] = split_counts(kv[rows], -(-q[rows] // tpt), hg, cap, self.target_programs,
                                             self.min_split_keys)
        _upload(self.seq_info, info)
        width = g.page_table.shape[1]
        assert width <= self.max_pages, (width, self.max_pages)  # the ring, or max_model_len / page_size
        self.page_table[:n, :width].copy_(g.page_table)
        for tiles, rows, tpt in zip(self.tiles[bucket], row_sets, self.tpt):
            nt = -(-q[rows] // tpt)  # tiles per sequence; the longest-running (last) tiles first, as AttnBatch
            seq = np.repeat(rows, nt)
            first = np.concatenate([(k - 1 - np.arange(k)) * tpt for k in nt]) if rows.size else np.zeros(0, np.int64)
            cap = tiles.shape[1]
            assert seq.size <= cap, (seq.size, cap)  # tiles_capacity bounds it
            host = np.empty((2, cap), dtype=np.int32)
            host[0, :], host[1, :] = self.max_seqs, 0
            host[0, :seq.size], host[1, :seq.size] = seq, first
            _upload(tiles, host)
        now, other = (self.slots_pre, self.slots_post) if g.pages_hold_all else (self.slots_post, self.slots_pre)
        now[:t].copy_(g.slot_mapping)
        now[t:bucket].fill_(-1)
        other[:bucket].fill_(-1)


def _upload(dst: torch.Tensor, host: np.ndarray) -> None:
    """A fresh pinned staging copy per step: the overlapped loop fills step N+1 while step N's copies
    may not have run yet, so a reused host buffer could be overwritten under them."""
    src = torch.from_numpy(host)
    dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=True)


def graphed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      tables: GroupTables, bucket: int, sinks: torch.Tensor, sm_scale: float, window: int | None,
                      kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [b, Hq, D], k/v [b, Hkv, D] (rotated k; any row/head strides, last dim contiguous) over the
    bucket's rows -> out [b, Hq, D]: each real row attends over its paged keys and the step's own (dense)
    ones as the tables say; padded rows come out zero. e4m3 pages are read through kv_scale."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    kc, vc = kv_cache
    widen = kc.dtype != q.dtype
    ks, vs = (sinks, sinks) if not widen else \
        page_scales(kv_scale if kc.dtype == torch.float8_e4m3fn else None, hkv, q.device)  # e4m3: [Hkv] fp32 each
    group = hq // hkv
    out = torch.zeros_like(q)  # padded rows: zeros, finite (engine/piecewise.py keeps padding finite)
    info, pt = tables.seq_info, tables.page_table
    caps = (1, 1) if window is not None else tables.splits
    # one-token rows (partials by tile: the table holds only q_len-1 rows), then chunks: disjoint rows
    for cfg, tiles, cap, by_tile in zip(tables.configs, tables.tiles[bucket], caps, (True, False)):
        num_tiles = tiles.shape[1]
        hg = hkv * (group // cfg.heads_per_program)
        parts = split_partials(cap, out, num_tiles if by_tile else b)
        _attn_fwd[(num_tiles, hg, cap)](
            q, k, v, kc, vc, pt, sinks, out, *parts, info, tiles, ks, vs,
            info.shape[1], num_tiles, b, hq, cap, sm_scale * LOG2E, window or 0,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), pt.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HPP=cfg.heads_per_program, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=d,
            PAGE=kc.shape[2], SPLIT=cap > 1, HAS_WINDOW=window is not None,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", KV_WIDEN=widen, ADAPTIVE=True,
            PART_BY_TILE=by_tile, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cap > 1:
            merge_tile_splits(parts, out, info, tiles, hg, group, cfg.heads_per_program, cfg.block_m, by_tile)
    return out


def graph_configs(group: int, device: torch.device) -> tuple[KernelConfig, KernelConfig]:
    """TritonAttention's launch shapes for one-token rows and for chunks (pick_config), fixed at capture."""
    return pick_config(group, 1, device), pick_config(group, 2, device)


def graph_splits(group: int, kv_heads: int, configs: tuple[KernelConfig, KernelConfig], device: torch.device
                 ) -> dict:
    """GroupTables' split-KV keywords for a full-attention group: GPU_SPLITS on a GPU, aiming at two programs
    per SM; none on the CPU interpreter (its tests pass their own)."""
    if device.type != "cuda":
        return {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return {"splits": GPU_SPLITS, "target_programs": 2 * sms,
            "head_groups": tuple(kv_heads * (group // c.heads_per_program) for c in configs)}
