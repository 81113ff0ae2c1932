"""The synthetic KV state of the KV-transfer benchmarks (benchmarks/kv_transfer.py, ipc_copy.py):
gpt-oss-120b-shaped pools (half the layers sliding; bf16, or e4m3 pages for FP8 KV), a hash pattern
of every coordinate that proves byte-exact delivery, and the page placements a decode worker's
allocator may hand out."""

from __future__ import annotations

import random

import torch

from model.kv_cache import KVCacheSpec, KVPool, PageGroup, SeqPages

MODEL = "gpt-oss-120b"
HEADS, HEAD_DIM, PAGE, WINDOW, HIDDEN = 8, 64, 16, 128, 2880
RING = -(-WINDOW // PAGE) + 1


def make_spec(layers: int, full_pages: int, ring_pages: int, dtype: torch.dtype = torch.bfloat16) -> KVCacheSpec:
    return KVCacheSpec(PAGE, HEADS, HEAD_DIM, dtype, WINDOW, tuple(range(1, layers, 2)),
                       tuple(range(0, layers, 2)), (full_pages, ring_pages))


def pattern(layer: int, pages: torch.Tensor, salt: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[2, N, H, P, D] a hash of every coordinate: bf16 integers in [-128, 127] (exact), or for e4m3
    pages the hash byte itself as the code (NaN codes 0x7f / 0xff turned into their neighbours, so
    torch.equal can compare)."""
    dev = pages.device
    kv = torch.arange(2, device=dev).view(2, 1, 1, 1, 1)
    h = torch.arange(HEADS, device=dev).view(1, 1, HEADS, 1, 1)
    p = torch.arange(PAGE, device=dev).view(1, 1, 1, PAGE, 1)
    d = torch.arange(HEAD_DIM, device=dev).view(1, 1, 1, 1, HEAD_DIM)
    x = ((((layer * 131 + salt * 7919 + kv) * 1_000_003 + pages.view(1, -1, 1, 1, 1)) * 64 + h) * 1024
         + p * 64 + d)
    byte = ((x * 2654435761) % (1 << 32)) >> 24
    if dtype == torch.float8_e4m3fn:
        byte = torch.where((byte & 0x7F) == 0x7F, byte ^ 1, byte)
        return byte.to(torch.uint8).view(torch.float8_e4m3fn)
    return byte.sub_(128).to(torch.bfloat16)


def fill_layer(pool: KVPool, layer: int, salt: int) -> None:
    g, li = pool.spec.group_of(layer)
    t = pool.pools[g][li]  # [2, NP, H, P, D]
    t.copy_(pattern(layer, torch.arange(t.shape[1], device=t.device), salt, t.dtype))


def src_pages(n: int) -> SeqPages:
    """Prefill pages as a fresh batch-1 allocator hands them out: 0..k-1."""
    nf = -(-n // PAGE)
    return SeqPages(list(range(nf)), list(range(min(RING, nf))))


def dst_pages(n: int, placement: str, pool_full: int, pool_ring: int, seed: int) -> SeqPages:
    nf, rng = -(-n // PAGE), random.Random(seed)
    if placement == "contig":
        return SeqPages(list(range(nf)), list(range(min(RING, nf))))
    if placement == "runs16":
        blocks = list(range(pool_full // 16))
        rng.shuffle(blocks)
        full = [b * 16 + i for b in blocks for i in range(16)][:nf]
    else:
        full = rng.sample(range(pool_full), nf)
    return SeqPages(full, rng.sample(range(pool_ring), min(RING, nf)))


def verify(pool: KVPool, pages: SeqPages, n: int, salt: int) -> bool:
    """Every logical page the transfer owes (full: all; sliding: the tail) holds the prefill pattern."""
    spec, ok = pool.spec, True
    for layer in (*spec.full_layers, *spec.sliding_layers):
        g, li = spec.group_of(layer)
        js = range(0, -(-n // PAGE)) if g == PageGroup.FULL else range(max(0, n - WINDOW + 1) // PAGE, -(-n // PAGE))
        sp = [j if g == PageGroup.FULL else j % RING for j in js]
        dp = [pages.full[j] if g == PageGroup.FULL else pages.ring[j % RING] for j in js]
        dev = pool.pools[g].device
        want = pattern(layer, torch.tensor(sp, device=dev), salt, spec.dtype)
        ok = ok and torch.equal(pool.pools[g][li][:, torch.tensor(dp, device=dev)], want)
    return ok


def transfer_bytes(n: int, layers: int, elt: int = 2) -> int:
    """Bytes one request of n tokens ships: every full-layer page, the sliding tail (elt bytes per value)."""
    nf, tail = -(-n // PAGE), -(-n // PAGE) - max(0, n - WINDOW + 1) // PAGE
    return (len(range(1, layers, 2)) * nf + len(range(0, layers, 2)) * tail) * 2 * HEADS * PAGE * HEAD_DIM * elt
