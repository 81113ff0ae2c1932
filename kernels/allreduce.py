"""One-shot all-reduce of decode-sized messages over torch symmetric memory (NVLink peer loads).

Why ours: torch's `one_shot_all_reduce_copy` took 12.8 us per call at 128 tokens x 2880 bf16 on two
H200s inside a CUDA graph (6.8 us at 1 token; run I): it launches few blocks, so a 737 KB message is
bound by the latency of each block's serial peer loads. This kernel spreads the message over up to
one program per SM:

  program p:  x[chunks of p] -> own symmetric buffer
              barrier with program p of every peer
              out[chunks of p] = sum over ranks r = 0..W-1 of buffer_r[chunks of p]
              barrier again: no rank overwrites its buffer (next call) while a peer still reads it

The sum runs in rank order in fp32 on every rank, so every rank gets the same bits (the TP ranks'
residual streams must not drift apart). Barriers are per program and pairwise through the signal
pads (int32 slots [program, rank]): CAS 0 -> 1 on the peer's slot [p, me] (release, system scope),
then CAS 1 -> 0 on our slot [p, peer] (acquire). A completed barrier leaves every slot at 0, so the
same pads serve every call and every CUDA-graph replay. All programs must be resident at once (a
program spins until its counterpart on each peer arrives): the grid is capped at the SM count.

GPU-only (CUDA, symmetric memory); `reduce_sum_reference` states the arithmetic for tests.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements per program per iteration: 8 warps x 32 threads x 8 bf16 (16-byte accesses)
NUM_WARPS = 8


@triton.jit
def _barrier(pads_ptr, pid, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Program `pid` of this rank meets program `pid` of every peer (see the module docstring)."""
    tl.debug_barrier()  # every thread's stores of this program precede the release below
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            remote = tl.load(pads_ptr + peer).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(remote + pid * WORLD + RANK, 0, 1, sem="release", scope="sys") != 0:
                pass
    local = tl.load(pads_ptr + RANK).to(tl.pointer_type(tl.int32))
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            while tl.atomic_cas(local + pid * WORLD + peer, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # no thread reads peer data before the acquire above


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, bufs_ptr, pads_ptr, n, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr):
    """x, out: [n] bf16 on this rank; bufs_ptr / pads_ptr: int64 [WORLD] device arrays of every rank's
    symmetric buffer / signal pad address."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    own = tl.multiple_of(tl.load(bufs_ptr + RANK).to(tl.pointer_type(tl.bfloat16)), 16)  # allocations: 16 B+
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(own + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    _barrier(pads_ptr, pid, RANK, WORLD)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            buf = tl.multiple_of(tl.load(bufs_ptr + r).to(tl.pointer_type(tl.bfloat16)), 16)
            # .cv: fetch from the owner every call (a stale L1 line of the previous call must not win)
            acc += tl.load(buf + offs, mask=m, other=0.0, cache_modifier=".cv").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=m)
    _barrier(pads_ptr, pid, RANK, WORLD)


def reduce_sum_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """What every rank gets: the fp32 sum in rank order, rounded once to bf16."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(torch.bfloat16)


class OneShotAllReduce:
    """Sum of bf16 tensors of up to `max_numel` elements over `world` ranks (every rank calls together),
    given every rank's buffer ([max_numel] bf16) and signal pad (zeroed int32 slots, `pad_bytes`)
    addresses, mapped into this process. Calls are graph-capturable: no allocation but the output,
    no host synchronisation."""

    def __init__(self, rank: int, world: int, buffer_ptrs: list[int], pad_ptrs: list[int], pad_bytes: int,
                 max_numel: int, device: torch.device) -> None:
        assert len(buffer_ptrs) == len(pad_ptrs) == world and 0 <= rank < world
        self.rank, self.world, self.max_numel = rank, world, max_numel
        self.bufs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=device)  # [W]
        self.pads = torch.tensor(pad_ptrs, dtype=torch.int64, device=device)  # [W]
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_programs = max(1, min(sms, pad_bytes // 4 // world))  # int32 slots [programs, W]

    @classmethod
    def symmetric(cls, group: Any, max_numel: int, device: torch.device) -> "OneShotAllReduce":
        """Buffers and pads from torch symmetric memory over `group` (a collective: call it on every
        rank, before CUDA-graph capture)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        self = cls(handle.rank, handle.world_size, list(handle.buffer_ptrs), list(handle.signal_pad_ptrs),
                   handle.signal_pad_size, max_numel, buf.device)
        self._keep = (buf, handle)
        # Every rank must launch the same grid (program p waits for program p of each peer): agree on
        # the smallest SM count in the group.
        agreed = torch.tensor([self.max_programs], dtype=torch.int64, device=buf.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        self.max_programs = int(agreed.item())
        handle.barrier()  # the pads are zero on every rank before the first kernel
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.bfloat16 and x.numel() <= self.max_numel, (x.dtype, x.numel())
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        grid = (min(self.max_programs, triton.cdiv(n, BLOCK)),)
        _one_shot_kernel[grid](x, out, self.bufs, self.pads, n, RANK=self.rank, WORLD=self.world, BLOCK=BLOCK,
                               num_warps=NUM_WARPS)
        return out
