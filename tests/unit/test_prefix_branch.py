"""Branch points (engine/prefix_branch.py): which prompt keeps the sliding KV of a shared prefix, and
where its chunk must end for the ring to still hold that prefix's window."""

from common.prefix_hash import block_hashes
from engine.prefix_branch import BranchPoints, keeps_branch

P, W, R = 16, 128, 9  # gpt-oss: 16-token pages, a 128-token window, a 9-page ring


def hashes(tokens):
    return block_hashes(tokens, P, 1)


def test_prefix_branch_ring_keeps_the_window_only_near_the_chunk_end():
    assert keeps_branch(192, 0, 200, P, W, R)  # the chunk ends in the branch's next block
    assert keeps_branch(192, 0, 192 + 15, P, W, R)
    assert not keeps_branch(192, 0, 192 + 16, P, W, R)  # one block more: the ring moved past block 4
    assert not keeps_branch(192, 0, 230, P, W, R)
    assert keeps_branch(192, 150, 207, P, W, R)  # blocks 4-9 came from earlier chunks, still in the ring
    assert keeps_branch(64, 0, 79, P, W, R) and not keeps_branch(64, 0, 80 + 130, P, W, R)  # short prefixes


def test_prefix_branch_found_where_a_seen_prompt_diverged():
    system = list(range(1000, 1200))  # 12 complete blocks + 8 tokens
    a, b, c = (hashes(system + list(range(5000 + 100 * i, 5030 + 100 * i))) for i in range(3))
    bp = BranchPoints(P, W, R)
    assert bp.find(a, 230, 0) == 0  # nothing seen yet
    bp.admitted(a, 0, 0)
    assert bp.find(b, 230, 0) == 192  # a went on differently after block 11
    assert bp.find(b, 230, 64) == 192 and bp.find(b, 230, 128) == 0  # at least a window (8 blocks) past the hit
    bp.admitted(b, 192, 0)
    assert bp.find(c, 230, 0) == 0  # b is about to keep it
    bp.done(b[11])
    assert bp.find(c, 230, 0) == 192
    assert bp.find(a, 230, 0) == 224 and bp.find(a, 225, 0) == 224 and bp.find(a, 224, 0) == 208  # >= 1 token left
    assert bp.find(a, 230, 208) == 224  # in the prompt's last block: kept without a split, one block is enough


def test_prefix_branch_chunk_ends_at_the_branch_only_when_it_must():
    bp = BranchPoints(P, W, R)
    assert bp.chunk(192, 0, 230) == 192
    assert bp.chunk(192, 0, 200) == 200 and bp.chunk(192, 0, 150) == 150 and bp.chunk(192, 192, 40) == 40
    assert bp.chunk(0, 0, 230) == 230


def test_prefix_branch_seen_set_is_bounded_lru():
    bp = BranchPoints(P, W, R, capacity=15)  # 10 blocks each
    old, new = hashes(list(range(160))), hashes(list(range(9000, 9160)))
    bp.admitted(old, 0, 0)
    bp.admitted(new, 0, 0)
    assert len(bp.seen) == 15 and all(h in bp.seen for h in new) and old[4] not in bp.seen and old[5] in bp.seen


def test_prefix_branch_remembers_only_blocks_past_the_hit():
    bp = BranchPoints(P, W, R)
    a = hashes(list(range(320)))
    bp.admitted(a, 0, 128)
    assert all(h not in bp.seen for h in a[:8]) and all(h in bp.seen for h in a[8:])
