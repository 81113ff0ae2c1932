"""Sharing a prompt's KV while its sequence still runs (n > 1: the later choices of one request).

The prefix cache normally indexes a sequence's blocks when it releases its pages (model/
prefix_cache.py). A sequence flagged `share_prompt` is indexed as soon as its prompt's KV exists
(its last prompt chunk launched, or its KV landed from a prefill worker), so the other choices of
the same request hit it while it decodes:
  * FULL: the prompt's complete blocks are indexed in place (shared by reference: the running
    sequence never writes them again, it writes from its last partial block on);
  * SLIDING: the ring's valid complete blocks are *copied* into fresh pages that the cache owns:
    the ring itself is overwritten as the sequence decodes (block j + R lands in slot j % R).
The same snapshot keeps a shared prefix's KV at a branch point (engine/prefix_branch.py), where the
ring was written past the point within the same step (`written_end`).
`snapshot_prompt` indexes them and returns the page copies to make (sliding group) and the fresh
pages' own references, which the caller drops once a step that follows the copies completed.
The copies are queued right behind the step that wrote the ring (engine/core.py), so they read it before
any later step writes it, and any hit's own ring copies come after them on the same stream.
"""

from __future__ import annotations

from model.kv_cache import KVManager, PageGroup, SeqPages
from model.page_allocator import OutOfPages


def snapshot_prompt(kv: KVManager, pages: SeqPages, hashes: list[int], num_valid: int, ring_valid_from: int,
                    written_end: int | None = None) -> tuple[list[int], list[int], SeqPages]:
    """Index the blocks of the first num_valid tokens now; the ring was written up to written_end (default
    num_valid; later for a branch point inside the step's chunk, engine/prefix_branch.py). Returns (sliding
    copy sources, destinations, held pages)."""
    c, spec = kv.cache, kv.spec
    held = SeqPages()
    if c is None:
        return [], [], held
    p, r = spec.page_size, spec.ring_pages
    n_blocks = min(len(hashes), num_valid // p)
    if c.full is not None:
        for j in range(min(n_blocks, len(pages.full))):
            c.full.insert(hashes[j], pages.full[j])
    if c.sliding is None or not pages.ring or pages.copy_src or n_blocks == 0:
        return [], [], held  # a ring still waiting for its hit's copies holds nothing valid yet
    last = ((num_valid if written_end is None else written_end) - 1) // p  # the ring's newest block
    first = max(-(-ring_valid_from // p), last - r + 1, 0)
    blocks = [j for j in range(first, n_blocks) if hashes[j] not in c.sliding and j % r < len(pages.ring)]
    if not blocks or kv.num_free()[PageGroup.SLIDING] < len(blocks):
        return [], [], held
    try:
        fresh = kv._allocate(PageGroup.SLIDING, len(blocks))
    except OutOfPages:
        return [], [], held
    for j, page in zip(blocks, fresh):
        c.sliding.insert(hashes[j], page)
    held.ring = fresh
    return [pages.ring[j % r] for j in blocks], list(fresh), held
