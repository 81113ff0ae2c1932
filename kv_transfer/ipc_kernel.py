"""The IPC data path's copy kernel: byte ranges from the local pool into a peer's mapped pool, one
Triton program per chunk. SM stores through peer pointers reach ~390 GB/s between two H200s over
NVLink where UCX's copy-engine path stops at 250-289 GB/s (benchmarks/nixl_probe.py), and one
launch covers any number of ranges (no per-descriptor host cost).

Imported lazily by kv_transfer/ipc.py on GPU only (and by its interpreter test), so a CPU-only
installation never needs a Triton backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 8  # bytes per element the kernel moves; ranges are 16-byte aligned, two words


@triton.jit
def _copy_chunks_kernel(src_ptr, dst_ptr, table_ptr, BLOCK: tl.constexpr):
    """Program i copies table[i] = (src word, dst word, words), at most BLOCK words. Every value is
    even (16-byte aligned), so the compiler may use 16-byte loads and stores."""
    i = tl.program_id(0).to(tl.int64)
    s = tl.multiple_of(tl.load(table_ptr + 3 * i), 2)
    d = tl.multiple_of(tl.load(table_ptr + 3 * i + 1), 2)
    n = tl.multiple_of(tl.load(table_ptr + 3 * i + 2), 2)
    e = tl.arange(0, BLOCK)
    if n == BLOCK:  # the bulk of a transfer: full chunks, no mask
        tl.store(dst_ptr + d + e, tl.load(src_ptr + s + e))
    else:  # the tail of a range
        m = e < n
        tl.store(dst_ptr + d + e, tl.load(src_ptr + s + e, mask=m), mask=m)


def copy_chunks(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, block_words: int) -> None:
    """src, dst: flat int64 views of the two pools; table: [M, 3] int64 (src word, dst word, words)
    on src's device, every entry even and every length <= block_words. Launches on the current
    stream and returns at once."""
    assert src.dtype == dst.dtype == table.dtype == torch.int64 and table.shape[1:] == (3,)
    assert src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0, "pools must be 16-byte aligned"
    if len(table):
        _copy_chunks_kernel[(len(table),)](src, dst, table, BLOCK=block_words, num_warps=4)
