"""The IPC data path's copy kernel (kv_transfer/ipc_kernel.py) on CPU through the Triton
interpreter: random 16-byte-aligned range lists, split into chunks as kv_transfer/ipc.py does,
land byte-exact and touch nothing else. Same-process tensors (the GPU run maps a peer's pool)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (no shared conftest on purpose)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from kv_transfer.ipc import split_chunks  # noqa: E402
from kv_transfer.ipc_kernel import WORD, copy_chunks  # noqa: E402


def _ranges(rng: np.random.Generator, n: int, size: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """n disjoint 16-byte-aligned ranges inside [0, size): (starts, lengths) in bytes, shuffled."""
    lengths = rng.integers(1, max_len // 16 + 1, n) * 16
    gaps = rng.integers(0, 4, n) * 16
    starts = np.cumsum(gaps + lengths) - lengths
    assert starts[-1] + lengths[-1] <= size
    order = rng.permutation(n)
    return starts[order], lengths[order]


@pytest.mark.parametrize("seed,n,chunk,li0,layers", [(0, 1, 64, 0, 1), (1, 7, 64, 1, 2), (2, 40, 256, 0, 3),
                                                     (3, 25, 16 << 10, 2, 1)])
def test_copy_chunks_byte_exact(seed, n, chunk, li0, layers):
    """Ranges of a first layer inside [0, 32 KiB) of each side; layer li sits li * 32 KiB further."""
    rng = np.random.default_rng(seed)
    stride, total = 1 << 15, 1 << 17
    src = torch.randint(-128, 127, (total,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(total, dtype=torch.int8)
    s, lengths = _ranges(rng, n, stride // 2, 512)
    d = rng.permutation(stride // 512)[:n] * 512  # 512-byte destination slots, scattered
    table = split_chunks(s, d, lengths, chunk)
    copy_chunks(src.view(torch.int64), dst.view(torch.int64), torch.from_numpy(table // WORD), chunk // WORD,
                li0, layers, stride // WORD, stride // WORD)
    want = torch.zeros(total, dtype=torch.int8)
    for li in range(li0, li0 + layers):
        for a, b, k in zip(s, d, lengths):
            want[li * stride + b:li * stride + b + k] = src[li * stride + a:li * stride + a + k]
    assert torch.equal(dst, want)


def test_copy_chunks_refuses_misaligned_pools():
    buf = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        copy_chunks(buf[1:], buf, torch.zeros(0, 3, dtype=torch.int64), 4)
