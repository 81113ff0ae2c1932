"""Branch points: where a worker keeps the sliding-window KV of a prefix that other prompts share.

The prefix cache keeps all of a sequence's full-attention blocks but only the tail of its sliding-window
blocks (gpt-oss's sliding layers see 128 keys, so its ring holds R = ceil(128/16) + 1 = 9 pages:
model/prefix_cache.py). Two prompts that share a system prompt and then diverge therefore shared no
KV: a hit at the shared boundary L needs the sliding blocks [L - 128, L), which the first prompt's ring
overwrote long ago. Agents resend the same multi-thousand-token tool preamble with every new
conversation; a chat UI's "regenerate" resends the same prompt.

The rule (SGLang's radix tree splits a node where two prompts diverge; this is that split point):
  * a worker remembers the block hashes of the prompts it admitted recently (a bounded LRU set; a
    block's hash names its whole prefix, common/prefix_hash.py);
  * an admitted prompt's longest *seen* prefix B (block-aligned, leaving >= 1 token to compute) that
    extends its usable cache hit is a branch: a prompt seen before went on differently after B, or ended
    there (a repeated prompt). B must extend the hit by a window's worth of blocks, or lie in the prompt's
    last block (kept without a split);
  * that sequence keeps its KV at B: once the step that writes position B - 1 is launched, its full
    blocks [0, B) are indexed in place and its ring's blocks [B - 128, B) copied into cache-owned pages
    (model/prefix_share.snapshot_prompt). Its chunk ends at B unless the chunk ends within a block of B
    anyway (then the ring still holds B's window after the step; `keeps_branch`). Every later prompt
    with that prefix hits at B.
One sequence per branch at a time snapshots (the others admitted while it is pending compute as before).
The cost is the snapshotting sequence's: its prompt is split at B (one more step before its first token
on a decode worker; one more launch on a prefill worker) and up to R sliding pages are copied.
"""

from __future__ import annotations

from collections import OrderedDict

from common.prefix_hash import max_hit_blocks, sliding_first_block
from model.context import ring_keep_from

SEEN_BLOCKS = 1 << 16  # block hashes remembered (~1M prompt tokens at 16 per block)


def keeps_branch(at: int, start: int, end: int, page_size: int, window: int, ring_pages: int) -> bool:
    """After a chunk [start, end) with start < at <= end is stored, does the ring still hold every sliding
    block a hit at `at` needs? Blocks valid after the step: from the least the chunk stores (when it cannot
    store all of it, engine.scheduler.note_ring_write) and within the last R written. (Blocks stored before
    the chunk are valid from sliding_first_block of any earlier hit or chunk end, both <= at's.)"""
    p = page_size
    keep = ring_keep_from(start, end, p, window)
    first_valid = max(-(-keep // p) if keep > start else 0, (end - 1) // p - ring_pages + 1, 0)
    return sliding_first_block(at // p, p, window) >= first_valid


class BranchPoints:
    """One worker's recently seen prompt blocks and the snapshots under way."""

    def __init__(self, page_size: int, window: int, ring_pages: int, capacity: int = SEEN_BLOCKS) -> None:
        self.page_size, self.window, self.ring_pages, self.capacity = page_size, window, ring_pages, capacity
        self.seen: OrderedDict[int, None] = OrderedDict()
        self.pending: set[int] = set()  # hash of block B - 1 of every branch a running sequence will snapshot

    def find(self, prompt_hashes: list[int], num_prompt_tokens: int, hit_tokens: int) -> int:
        """The branch point (tokens) of a prompt whose usable hit is hit_tokens, or 0. Reads only."""
        p = self.page_size
        limit = min(max_hit_blocks(num_prompt_tokens, p), len(prompt_hashes))
        b = k = hit_tokens // p
        while b < limit and prompt_hashes[b] in self.seen:
            b += 1
        # a branch in the prompt's last block is kept without a split (its chunk ends there): any gain will do;
        # elsewhere the split must save a window's worth of blocks
        need = 1 if num_prompt_tokens - b * p < p else max(1, -(-self.window // p))
        if b - k < need or prompt_hashes[b - 1] in self.pending:
            return 0  # too little to gain, or another sequence is about to keep it
        return b * p

    def admitted(self, prompt_hashes: list[int], at: int, hit_tokens: int) -> None:
        """A prompt was admitted with branch point `at` (0: none): remember its blocks past its hit (a later prompt
        sharing blocks below it will hit them too; a multi-turn turn adds only its new blocks, ~20 a turn)."""
        if at:
            self.pending.add(prompt_hashes[at // self.page_size - 1])
        self.observe(prompt_hashes[hit_tokens // self.page_size:])

    def observe(self, hashes: list[int]) -> None:
        seen = self.seen
        for h in hashes:
            if h in seen:
                seen.move_to_end(h)
            else:
                seen[h] = None
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def chunk(self, at: int, start: int, q: int) -> int:
        """A chunk of q tokens from start, ended at the branch `at` when the ring would move past its window."""
        if not at or not start < at < start + q:
            return q
        return q if keeps_branch(at, start, start + q, self.page_size, self.window, self.ring_pages) else at - start

    def done(self, block_hash: int) -> None:
        """The branch's snapshot was taken (or its sequence left before it): another sequence may take it."""
        self.pending.discard(block_hash)
