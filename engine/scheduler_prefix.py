"""The scheduler's prefix-cache side (engine/scheduler.py's Scheduler mixes it in): block hashes, the lookup at
admission, mapping a hit's pages, what a releasing sequence registers, and indexing a prompt while its sequence
still runs: n > 1 choices (share_prompt, model/prefix_share.py) and branch points (engine/prefix_branch.py).

Indexing a running sequence copies its ring's blocks into cache-owned pages right behind the launch that wrote
them (engine/core.py queues `pending_copies` after `on_launch`, and those indexed between steps before the next
launch): before any later step writes the ring.
"""

from __future__ import annotations

from common.prefix_hash import extend_hashes, sliding_first_block
from engine.prefix_branch import BranchPoints
from engine.sequence import Sequence
from model.kv_cache import KVManager, SeqPages
from model.prefix_cache import Hit
from model.prefix_share import snapshot_prompt


class PrefixScheduling:
    """Needs the Scheduler's kv, branches, share_prompts, launched, pending_copies, _fenced, _copies_behind."""

    kv: KVManager
    branches: BranchPoints | None
    share_prompts: bool
    launched: int
    pending_copies: list[tuple[list[int], list[int]]]

    def hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Block hashes of seq's first num_tokens tokens (complete blocks), extended as needed."""
        c = self.kv.cache
        assert c is not None
        p = self.kv.spec.page_size
        if len(seq.block_hashes) < num_tokens // p:
            extend_hashes(seq.block_hashes, seq.token_slice(0, num_tokens // p * p), p, c.root)
        return seq.block_hashes[:num_tokens // p]

    def lookup(self, seq: Sequence) -> Hit:
        """The cached prefix a WAITING sequence (nothing cached yet) would get now."""
        # prompt logprobs want every prompt position's logits: such a sequence computes them all
        if (self.kv.cache is None or seq.num_cached or seq.pages.full or seq.pages.ring
                or seq.params.prompt_logprobs is not None):
            return Hit()
        n = seq.num_tokens
        return self.kv.cache.match(self.hashes(seq, n), n)

    def admit_pages(self, seq: Sequence, hit: Hit, total: int, at: int | None = None) -> None:
        """Pages for an admitted sequence's first `total` tokens, the hit's mapped in; `at`: its branch point
        (branch_of; None: found here)."""
        spec = self.kv.spec
        if hit.num_tokens:
            self.kv.map_hit(seq.pages, hit, total)
            seq.num_cached = hit.num_tokens
            seq.ring_valid_from = sliding_first_block(hit.num_tokens // spec.page_size, spec.page_size,
                                                      spec.sliding_window) * spec.page_size
        else:
            self.kv.grow(seq.pages, total)
            seq.ring_valid_from = 0
        seq.num_cached_prefix = hit.num_tokens
        if self.kv.cache is not None:
            self.kv.cache.count(seq.num_tokens, hit.num_tokens)
        if self._takes_branches(seq):
            seq.snapshot_at = self.branch_of(seq, hit) if at is None else at
            branches = self.branches
            assert branches is not None
            branches.admitted(self.hashes(seq, len(seq.prompt_ids)), seq.snapshot_at, hit.num_tokens)

    # ---- branch points (engine/prefix_branch.py) ----------------------------------------------------
    def _takes_branches(self, seq: Sequence) -> bool:
        """A preempted sequence's recompute (it has output) is not a new prompt; a TP group's runner cannot copy
        pages; a model without sliding layers (or a worker without a cache) needs none."""
        return self.branches is not None and self.share_prompts and not seq.output_ids

    def branch_of(self, seq: Sequence, hit: Hit) -> int:
        """Where an admitted prompt would keep its KV for others (tokens), 0 for nowhere."""
        if not self._takes_branches(seq):
            return 0
        n = len(seq.prompt_ids)
        return self.branches.find(self.hashes(seq, n), n, hit.num_tokens)  # type: ignore[union-attr]

    @staticmethod
    def branch_due(seq: Sequence, start: int, end: int) -> bool:
        """The chunk [start, end) writes the last position before seq's branch point: snapshot after it."""
        return bool(seq.snapshot_at) and start < seq.snapshot_at <= end

    def chunk_len(self, seq: Sequence, start: int, q: int) -> int:
        """A prompt chunk of q tokens from start, ended at the sequence's branch point when it must."""
        return self.branches.chunk(seq.snapshot_at, start, q) if seq.snapshot_at and self.branches else q

    def snapshot_branch(self, seq: Sequence, written_end: int) -> tuple[list[int], list[int], SeqPages]:
        """The launch writing [.., written_end) reaches seq's branch point: index its blocks now (sliding
        copies to make, pages to hold until they ran: model/prefix_share.snapshot_prompt)."""
        at = seq.snapshot_at
        got = snapshot_prompt(self.kv, seq.pages, self.hashes(seq, at), at, seq.ring_valid_from, written_end)
        self.forget_branch(seq)
        if got[0]:  # its window copied (none when no sliding page was free; the next such prompt tries again)
            self.kv.cache.stats.branch_snapshots += 1  # type: ignore[union-attr]
        return got

    def forget_branch(self, seq: Sequence) -> None:
        if seq.snapshot_at and self.branches is not None:
            self.branches.done(seq.block_hashes[seq.snapshot_at // self.kv.spec.page_size - 1])
        seq.snapshot_at = 0

    def registration(self, seq: Sequence) -> tuple[list[int], int, int] | None:
        """What a releasing sequence adds to the prefix cache: its blocks with computed KV."""
        if self.kv.cache is None:
            return None
        n = min(seq.num_cached, seq.num_tokens)
        return self.hashes(seq, n), n, seq.ring_valid_from

    def share_prompt(self, seq: Sequence) -> None:
        """Index a running sequence's prompt in the prefix cache now (model/prefix_share.py)."""
        if self.kv.cache is None or not self.share_prompts:
            return
        n = len(seq.prompt_ids)
        self._copy_behind(*snapshot_prompt(self.kv, seq.pages, self.hashes(seq, n), n, seq.ring_valid_from))

    def _copy_behind(self, src: list[int], dst: list[int], held: SeqPages) -> None:
        """Ring blocks into cache pages, copied right behind the launch being booked (engine/core.py), before any
        later step writes the ring; the fresh pages' own references go once the step after it completed."""
        if src:
            self.pending_copies.append((src, dst))
            self._fenced.append((self.launched + 1, held))
            self._copies_behind = self.launched

