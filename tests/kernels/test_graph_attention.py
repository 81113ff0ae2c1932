"""kernels/triton_graph_attention.py in the Triton CPU interpreter: the per-step tables (one-token rows in
decode-shaped tiles, chunks in prefill-shaped ones, padded tiles on the empty sequence) and the two launches
on a bucket's rows against kernels/reference.py, with the GPU's two tile shapes (16-row decode tiles,
larger chunk tiles) rather than the one shape the CPU's pick_config gives both; padded rows come out zero.
(The pieces built on it are checked bit for bit against the eager backend in tests/integration/test_piecewise.py.)"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.interface import GroupMeta, StepMeta  # noqa: E402
from kernels.triton_attention import KernelConfig  # noqa: E402
from kernels.triton_graph_attention import GroupTables, graphed_attention  # noqa: E402
from tests.kernels.test_triton_attention import Case, check  # noqa: E402

BUCKET = 48


def _step(c: Case, hold_all: bool) -> StepMeta:
    t = sum(c.q_lens)
    g = GroupMeta(c.page_table, torch.tensor(c.prefix_lens, dtype=torch.int32),
                  torch.tensor(c.kv_lens, dtype=torch.int32), torch.full((t,), -1, dtype=torch.int64), hold_all,
                  list(c.prefix_lens), list(c.kv_lens))
    return StepMeta(torch.zeros(t, dtype=torch.long), c.cu, list(c.q_lens), torch.zeros(len(c.q_lens), dtype=torch.long),
                    (g, None))


def _pad(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.cat([x, torch.randn(BUCKET - x.shape[0], *x.shape[1:], generator=gen)])  # stale rows


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hold_all", [True, False])
def test_graphed_attention_two_tile_shapes(window, hold_all):
    """Decode rows beside chunks, every key from the pages (full layers, rings that hold the step) or the
    prefix from the pages and the step's own keys dense (a sliding chunk past its ring)."""
    group, hkv = 8, 2
    c = Case([1, 9, 1, 14, 1], [20, 6, 3, 0, 11], hq=group * hkv, hkv=hkv, seed=3)
    cfgs = (KernelConfig(16, 16, 8), KernelConfig(64, 16, 8))  # 2 and 8 tokens per tile
    tables = GroupTables((16, BUCKET), max_seqs=6, max_pages=c.page_table.shape[1], group=0,
                         device=torch.device("cpu"), configs=cfgs)
    tables.fill(_step(c, hold_all), BUCKET)
    dec, chunk = tables.tiles[BUCKET]
    assert dec[0, :3].tolist() == [0, 2, 4] and set(dec[0, 3:].tolist()) == {6}  # one tile per decode row
    assert sorted(chunk[0, :4].tolist()) == [1, 1, 3, 3] and set(chunk[0, 4:].tolist()) == {6}
    gen = torch.Generator().manual_seed(9)
    q, k, v = (_pad(x, gen) for x in (c.q, c.k, c.v))
    out = graphed_attention(q, k, v, (c.k_cache, c.v_cache), tables, BUCKET, c.sinks, 0.25, window)
    t = sum(c.q_lens)
    want = c.ref_all_paged(0.25, window) if hold_all else c.ref_prefix_dense(0.25, window)
    check(out[:t], want, torch.float32)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))
    # a smaller step refills the same tables: no tile of the earlier step is left
    small = Case([1, 3], [4, 2], hq=group * hkv, hkv=hkv, seed=4)
    tables.fill(_step(small, hold_all), BUCKET)
    assert dec[0, 1:].eq(6).all() and chunk[0, 1:].eq(6).all()


def _split_tables(c: Case, splits, min_keys: int) -> GroupTables:
    cfgs = (KernelConfig(16, 16, 8), KernelConfig(64, 16, 8))
    return GroupTables((BUCKET,), max_seqs=6, max_pages=c.page_table.shape[1], group=0, device=torch.device("cpu"),
                       configs=cfgs, splits=splits, head_groups=(2, 2), target_programs=64, min_split_keys=min_keys)


@pytest.mark.parametrize("hold_all", [True, False])
def test_graphed_attention_split_kv(hold_all):
    """Full layers split long sequences' keys per the tables (seq_info row 5) and merge by tile: decode rows at
    ~150 keys beside a short one and a chunk, against the reference; padded rows stay zero. With the same caps
    but pieces too large to split, split 0 writes every row itself: bit-equal to the unsplit launch."""
    group, hkv = 8, 2
    c = Case([1, 9, 1, 1], [150, 90, 3, 120], hq=group * hkv, hkv=hkv, seed=5)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_pad(x, gen) for x in (c.q, c.k, c.v))
    t = sum(c.q_lens)
    want = c.ref_all_paged(0.25, None) if hold_all else c.ref_prefix_dense(0.25, None)
    tables = _split_tables(c, (4, 3), min_keys=32)
    tables.fill(_step(c, hold_all), BUCKET)
    counts = tables.seq_info[5, :4].tolist()
    assert counts[0] == 4 and counts[2] == 1 and counts[3] == 4 and counts[1] > 1, counts
    out = graphed_attention(q, k, v, (c.k_cache, c.v_cache), tables, BUCKET, c.sinks, 0.25, None)
    check(out[:t], want, torch.float32)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))
    whole = _split_tables(c, (4, 3), min_keys=10_000)
    whole.fill(_step(c, hold_all), BUCKET)
    assert whole.seq_info[5, :4].tolist() == [1, 1, 1, 1]
    unsplit = _split_tables(c, (1, 1), min_keys=32)
    unsplit.fill(_step(c, hold_all), BUCKET)
    base = graphed_attention(q, k, v, (c.k_cache, c.v_cache), unsplit, BUCKET, c.sinks, 0.25, None)
    assert torch.equal(graphed_attention(q, k, v, (c.k_cache, c.v_cache), whole, BUCKET, c.sinks, 0.25, None), base)
    # sliding layers never split, whatever the tables' caps
    assert torch.equal(graphed_attention(q, k, v, (c.k_cache, c.v_cache), tables, BUCKET, c.sinks, 0.25, 5),
                       graphed_attention(q, k, v, (c.k_cache, c.v_cache), unsplit, BUCKET, c.sinks, 0.25, 5))


def test_split_counts_policy():
    """Many sequences at a modest context fill the grid unsplit; one long sequence among them splits to the cap; a
    few long ones split evenly; pieces never fall below min_keys; cap 1 never splits."""
    from kernels.attention_splits import split_counts  # noqa: PLC0415
    ones = np.ones(64, dtype=np.int64)
    assert split_counts(np.full(64, 4096), ones, 8, 16, 264, 1024).tolist() == [1] * 64
    mixed = split_counts(np.array([100_000] + [1000] * 63), ones, 8, 16, 264, 1024)
    assert mixed[0] == 16 and (mixed[1:] == 1).all()
    assert split_counts(np.full(4, 8192), np.ones(4), 8, 16, 264, 1024).tolist() == [8] * 4
    assert split_counts(np.full(2, 1500), np.ones(2), 8, 16, 264, 1024).tolist() == [2, 2]
    assert split_counts(np.full(4, 8192), np.ones(4), 8, 1, 264, 1024).tolist() == [1] * 4
    # chunk tiles count their tiles' work: a 300-token chunk (19 tiles) at 50k context splits less than a decode row
    assert split_counts(np.array([50_000]), np.array([19]), 8, 16, 264, 1024)[0] == 2
    assert split_counts(np.array([50_000]), np.array([1]), 8, 16, 264, 1024)[0] == 16
