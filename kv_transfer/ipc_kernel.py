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


@triton.jit(do_not_specialize=["li0"])
def _copy_chunks_kernel(src_ptr, dst_ptr, table_ptr, li0, src_stride, dst_stride, BLOCK: tl.constexpr):
    """Program (i, j) copies chunk i of layer li0 + j: table[i] = (src word, dst word, words) of the
    plan's first layer, shifted by the layer times each side's stride (words). Every offset and
    length is even (16-byte aligned), so the compiler may use 16-byte loads and stores."""
    i = tl.program_id(0).to(tl.int64)
    li = (li0 + tl.program_id(1)).to(tl.int64)
    s = tl.multiple_of(tl.load(table_ptr + 3 * i) + li * src_stride, 2)
    d = tl.multiple_of(tl.load(table_ptr + 3 * i + 1) + li * dst_stride, 2)
    n = tl.multiple_of(tl.load(table_ptr + 3 * i + 2), 2)
    e = tl.arange(0, BLOCK)
    if n == BLOCK:  # the bulk of a transfer: full chunks, no mask
        tl.store(dst_ptr + d + e, tl.load(src_ptr + s + e))
    else:  # the tail of a range
        m = e < n
        tl.store(dst_ptr + d + e, tl.load(src_ptr + s + e, mask=m), mask=m)


_COMPILED: dict[tuple, object] = {}  # specialisation -> triton CompiledKernel (None: launch through the JIT)


def copy_chunks(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, block_words: int, li0: int = 0,
                num_layers: int = 1, src_stride: int = 0, dst_stride: int = 0) -> None:
    """src, dst: flat int64 views of the two pools; table: [M, 3] int64 (src word, dst word, words)
    on src's device, every entry even and every length <= block_words; layers li0 .. li0 +
    num_layers - 1 are copied, layer li shifted by li * stride words on each side (even). Launches
    on the current stream and returns at once."""
    assert src.dtype == dst.dtype == table.dtype == torch.int64 and table.shape[1:] == (3,)
    assert src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0, "pools must be 16-byte aligned"
    assert table.data_ptr() % 16 == 0 and src_stride % 2 == 0 and dst_stride % 2 == 0, "16-byte alignment"
    if not len(table) or not num_layers:
        return
    grid = (len(table), num_layers)
    args = (src, dst, table, li0, src_stride, dst_stride)
    # The JIT's per-call argument binding costs ~45 us of host time on the H200 machine, one launch
    # per layer of every WRITE; the compiled kernel's own launcher ~20 us. Keyed by everything the
    # JIT specialises on here (16-byte pointers are asserted above; li0 is not specialised).
    key = (block_words, src.device.index, *((x % 16 == 0, x == 1, x >= 1 << 31) for x in (src_stride, dst_stride)))
    ck = _COMPILED.get(key)
    if ck is not None:
        try:
            ck[(*grid, 1)](*args, block_words)
            return
        except TypeError:  # another Triton's launcher signature: the JIT from now on (a repeated copy is harmless)
            _COMPILED[key] = None
    compiled = _copy_chunks_kernel[grid](*args, BLOCK=block_words, num_warps=4)
    _COMPILED.setdefault(key, compiled if hasattr(compiled, "__getitem__") else None)  # None: the interpreter
