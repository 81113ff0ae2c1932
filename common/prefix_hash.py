"""Prefix-cache block identity and the hit rule, shared by the workers' page cache and the router's
index (torch-free: the router imports it).

A prompt is cut into blocks of `page_size` tokens (one KV page each). Block j's hash chains its
parent's: h_j = H(h_{j-1} || tokens of block j), h_{-1} = H(identity), where the identity names the
model and the KV layout (a worker's `cache_identity`: weights fingerprint, page size, KV dtype), so
two caches only ever agree on a hash when they would hold the same bytes for it. h_j therefore
names the whole prefix [0, (j+1)P); a partial last block has no hash and is never shared.

The hit rule for gpt-oss (two page groups, model/kv_cache.py):
  * full-attention layers need every block before the hit boundary L = kP;
  * sliding-window layers (window W) need only the keys a query at L can see, positions > L - W:
    blocks [sliding_first_block(k), k). With W = 128, P = 16 that is blocks k-8 .. k-1 ([L-128, L)).
A hit at L is usable only when both groups hold their blocks; the lookup takes the largest such L,
and at least one prompt token is always left to compute (its logits give the first output token).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence

_ROOT_TAG = b"tandem-prefix-v1"


def identity_root(identity: str) -> int:
    """h_{-1}: the chain's seed for one model + KV layout."""
    return int.from_bytes(hashlib.blake2b(_ROOT_TAG + identity.encode(), digest_size=8).digest(), "little")


def extend_hashes(hashes: list[int], token_ids: Sequence[int], page_size: int, root: int) -> list[int]:
    """Append the hashes of the complete blocks of `token_ids` not yet in `hashes` (in place; the
    first len(hashes) blocks are assumed unchanged). Returns `hashes`."""
    n_blocks = len(token_ids) // page_size
    first = len(hashes)
    if first >= n_blocks:
        return hashes
    parent = hashes[-1] if hashes else root
    # H(parent as <Q || the block as <I...): the new blocks' tokens packed in one call (a per-block
    # struct.pack of 17 values cost ~2 us a block: ~0.5 ms for a 4k-token prompt, hashed per request)
    step = 4 * page_size
    data = struct.pack(f"<{(n_blocks - first) * page_size}I", *token_ids[first * page_size:n_blocks * page_size])
    blake2b = hashlib.blake2b
    for i in range(0, len(data), step):
        parent = int.from_bytes(blake2b(parent.to_bytes(8, "little") + data[i:i + step], digest_size=8).digest(),
                                "little")
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], page_size: int, root: int) -> list[int]:
    return extend_hashes([], token_ids, page_size, root)


def sliding_first_block(k: int, page_size: int, window: int) -> int:
    """First block a hit at L = k * page_size needs in the sliding group (keys > L - window)."""
    return max(0, k * page_size - window + 1) // page_size


def max_hit_blocks(num_tokens: int, page_size: int) -> int:
    """Blocks a prompt of num_tokens may take from a cache: complete ones, leaving >= 1 token to compute."""
    return max(0, num_tokens - 1) // page_size


def hit_blocks(hashes: Sequence[int], limit: int, has_full: Callable[[int], bool] | None,
               has_sliding: Callable[[int], bool] | None, page_size: int, window: int) -> int:
    """The largest k <= limit such that blocks [0, k) are cached in the full group and blocks
    [sliding_first_block(k), k) in the sliding group (a group the model lacks passes None)."""
    k = 0
    limit = min(limit, len(hashes))
    if has_full is not None:
        while k < limit and has_full(hashes[k]):
            k += 1
    else:
        k = limit
    if has_sliding is None:
        return k
    # Walk down from k: the sliding blocks a candidate needs are a window ending at it, so the
    # nearest missing sliding block below k rules out every candidate whose window contains it.
    while k > 0:
        first = sliding_first_block(k, page_size, window)
        missing = next((j for j in range(k - 1, first - 1, -1) if not has_sliding(hashes[j])), None)
        if missing is None:
            return k
        k = missing  # candidates in (missing, k] all need block `missing`
    return 0


def released_sliding_blocks(num_valid: int, page_size: int, window: int) -> range:
    """Sliding blocks a sequence with num_valid computed tokens leaves cached when it ends: its
    ring's complete blocks, the last R = ceil(W / P) + 1 written (model/prefix_cache.py; the worker
    may keep fewer when a big chunk stored only its tail)."""
    if num_valid <= 0:
        return range(0)
    ring = -(-window // page_size) + 1
    return range(max(0, (num_valid - 1) // page_size - ring + 1), num_valid // page_size)
