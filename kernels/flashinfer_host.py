"""The host side of FlashInferAttention (kernels/flashinfer_backend.py), apart from the backend so it
imports without CUDA: the backend's shapes, importing flashinfer with its JIT cache folder, pinned
host -> device uploads, and the per-step index arithmetic of a chunk step's dense [cached prefix ; new]
keys (numpy; tests/kernels/test_fp8_kv.py checks it on the CPU)."""

from __future__ import annotations

import builtins
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import ConfigError
from kernels.interface import StepMeta


@dataclass(frozen=True, slots=True)
class AttentionDims:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: torch.device
    kv_dtype: torch.dtype | None = None  # the pages' dtype; None = dtype

    @property
    def fp8_kv(self) -> bool:
        return self.kv_dtype == torch.float8_e4m3fn


def import_flashinfer(cache_dir: str | None = None):
    """Import flashinfer with its JIT cache under `cache_dir` (which must be set before import)."""
    if cache_dir is not None:
        cache_dir = os.path.abspath(cache_dir)
        if "flashinfer" in sys.modules and os.environ.get("FLASHINFER_WORKSPACE_BASE") != cache_dir:
            raise ConfigError(f"flashinfer was already imported with another JIT cache folder; "
                              f"cannot switch to {cache_dir}")
        os.makedirs(cache_dir, exist_ok=True)
        os.environ["FLASHINFER_WORKSPACE_BASE"] = cache_dir
    if not torch.cuda.is_available():
        raise ConfigError("the flashinfer attention backend needs a CUDA GPU; use 'triton' or 'torch'")
    try:
        import flashinfer
        import flashinfer.prefill
        from flashinfer.jit.attention.variants import attention_sink_decl  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"the flashinfer attention backend needs flashinfer-python 0.6.6 "
                          f"(+ apache-tvm-ffi, nvidia-cudnn-frontend): {e}") from None
    if os.environ.get("TANDEM_FI_TENSOR_MAX", "1") != "0":  # patch_tensor_max; =0 keeps FlashInfer's own max
        patch_tensor_max(flashinfer.prefill)
    return flashinfer


def tensor_max(*args, **kwargs):
    """builtins.max, except that the max of one tensor is torch.max's (a 0-d tensor, as builtins.max returns)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return torch.max(args[0])
    return builtins.max(*args, **kwargs)


def patch_tensor_max(module) -> None:
    """FlashInfer 0.6.6's paged prefill plan (prefill.py), which reads every step of ours, takes
    `max(lengths).item()` of 1-D host tensors twice a call. Python's max iterates a tensor element by
    element (a 0-d tensor, a comparison and a bool each): ~80 us at 64 sequences on the CPU machine against
    ~1 us for torch.max. Four such calls per decode step (two page groups) are host launch time on the
    overlapped loop's critical path, growing with the batch. The module's `max` is shadowed by tensor_max:
    the same values for every other use (lists, several arguments; the module's five uses were read).
    On by default since graphed-default-check-1 (H100, 2026-12-07): the graph-capture GPU tests passed with it
    (18) and benchmarks/plan_host.py timed a decode step's plan at 3.01 -> 2.07 ms for 64 sequences at 3.5k
    (1.34 -> 0.80 at 16, 5.50 -> 4.00 at 128); TANDEM_FI_TENSOR_MAX=0 leaves FlashInfer's module as shipped."""
    if getattr(module, "max", None) is not tensor_max:
        module.max = tensor_max


def host_cu(step: StepMeta) -> torch.Tensor:
    """cu_seqlens_q on the host without a device sync."""
    return pinned(torch.tensor([0] + step.q_lens_host, dtype=torch.int32).cumsum(0, dtype=torch.int32))


def pinned(t: torch.Tensor) -> torch.Tensor:
    """Host tensors the plan copies to the device (index buffers of the graph wrappers) live in
    pinned memory: a copy from pageable memory may wait for the stream, and the overlapped decode
    loop plans step N+1 while step N still runs."""
    return t.pin_memory() if torch.cuda.is_available() else t


def chunk_gather_indices(prefix_lens: list[int], q_lens: list[int], max_pages: int, page_size: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where each key of a chunk step's dense [prefix ; new] K/V comes from and goes: for every
    prefix position i of sequence b, its page-table entry b * max_pages + i // P, its offset i % P
    and its row in the dense keys; the rows of the new tokens; and cu_k [B+1] int32 (keys per
    sequence = prefix + new). int64 except cu_k."""
    pre = np.asarray(prefix_lens, dtype=np.int64)
    q = np.asarray(q_lens, dtype=np.int64)
    cu_k = np.zeros(len(pre) + 1, dtype=np.int64)
    np.cumsum(pre + q, out=cu_k[1:])
    cu_pre = np.concatenate([[0], np.cumsum(pre)])
    cu_new = np.concatenate([[0], np.cumsum(q)])
    i = np.arange(cu_pre[-1]) - np.repeat(cu_pre[:-1], pre)  # position within its sequence's prefix
    flat = np.repeat(np.arange(len(pre)) * max_pages, pre) + i // page_size
    dst_pre = np.repeat(cu_k[:-1], pre) + i
    dst_new = np.repeat(cu_k[:-1] + pre, q) + np.arange(cu_new[-1]) - np.repeat(cu_new[:-1], q)
    return flat, i % page_size, dst_pre, dst_new, cu_k.astype(np.int32)


def chunk_row_sources(flat: np.ndarray, offs: np.ndarray, dst_pre: np.ndarray, dst_new: np.ndarray,
                      page_table: torch.Tensor, page_size: int, upload) -> torch.Tensor:
    """[Tk] int64 source of every dense row of a chunk step (chunk_gather_indices' arrays), for the
    layers' one-launch gather (kernels.triton_store_kv.gather_kv): page * P + offset for a prefix row,
    -(j + 1) for new token j. Built once per step: one upload, then the prefix rows' pages looked up
    in the device page table [B, max_pages]."""
    src = np.empty(dst_pre.size + dst_new.size, dtype=np.int64)
    src[dst_new] = -1 - np.arange(dst_new.size)
    src[dst_pre] = offs
    idx = upload(np.concatenate([src, flat, dst_pre]))
    n_src, n_pre = src.size, flat.size
    rows = idx[:n_src]
    pages = page_table.flatten()[idx[n_src:n_src + n_pre]].long()  # [n_pre] the prefix rows' pages
    dst = idx[n_src + n_pre:]  # [n_pre] their rows (distinct)
    rows[dst] = rows[dst] + pages * page_size
    return rows
