"""Same-node data path of the NIXL sender/receiver (TransferBackend.IPC): NIXL stays the control
plane (agent metadata, notifications, liveness), but the bytes move by a copy straight into the
decode rank's pool, mapped into the prefill process.

Decode (`export_pools`, once per receiver, BEFORE NIXL registers the pools): every non-empty pool
tensor is exported the way torch.multiprocessing shares a storage.
  CUDA: `_share_cuda_()`: the allocation's IPC handle, torch's ref-counter slot and an IPC event.
  CPU:  `_share_filename_cpu_()` moves the storage into a shared-memory file IN PLACE: the pool
        tensors and every view of them stay valid, but their data pointer changes (hence first).
Prefill (`IpcPaths.target`, once per decode agent): the Handshake's export is used only when it
comes from this host (boot id), matches our memory kind, and on CUDA names a GPU we see and can
reach (peer access); otherwise, or when mapping fails, that peer gets NIXL WRITEs. Either way the
choice is logged once per peer.
A WRITE step: the sender hands us the (WritePlan, layer) pairs it would post as NIXL descriptors
(kv_transfer/plan.py: absolute addresses in each side's address space, the first layer's ranges
plus a per-layer stride). Once per plan, `IpcTarget` subtracts the pool bases (ours from
NixlAgent.layouts, the peer's from its Handshake) to get byte offsets per page group.
  CUDA: once per plan the ranges are split into 16 KiB chunks (numpy) and uploaded; a WRITE is a
        Triton launch per plan on a side stream (programs: chunks x layers), then an event is
        recorded: the WRITE's handle. WRITEs posted while the last launch is still running are
        queued and merged into the next launch. The layers' completion events were waited for
        before the sender calls us.
  CPU:  synchronous slice copies.
`done()` turns true once the copy completed and then sends the LayerDone notification with
NixlAgent.send_notif, so decode sees exactly what it sees after a NIXL WRITE with notification (a
dead decode shows up there as PeerGone). `release()` cannot cancel a running copy: it reports
False until the event completed, and the sender keeps draining (fail-closed, as with NIXL).

Ref counts (CUDA): torch counts one consumer per `_share_cuda_` call; we export once per decode
epoch for every prefill rank that maps it. The count only decides when torch releases a pool block
the decode process has freed, and decode frees its pools only when it shuts down.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.messages import Handshake, IpcPool, PoolLayout
from kv_transfer.nixl_backend import NixlAgent, TransportError
from kv_transfer.plan import WritePlan
from model.kv_cache import KVPool, PageGroup

log = logging.getLogger(__name__)

DATA_PATHS = ("nixl", "ipc")  # how NixlSender/NixlReceiver move the bytes: NIXL WRITE, or this module
CHUNK_BYTES = 16 << 10  # one copy-kernel program; ranges are split on the host
ALIGN = 16  # the kernel's vector width; every range of the plan is a multiple of a head's bytes


def node_id() -> str:
    """This host's identity: the kernel's boot id (same for every process of one boot)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _uuid(device: int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pools(pool: KVPool) -> tuple[IpcPool, ...]:
    """Decode side: share every non-empty pool tensor (see the module docstring)."""
    node, out = node_id(), []
    for g in PageGroup:
        t = pool.pools[g]
        if t.numel() == 0:
            continue
        st = t.untyped_storage()
        assert t.is_contiguous() and t.storage_offset() == 0 and st.nbytes() == t.numel() * t.element_size()
        if t.is_cuda:
            dev, handle, size, offset, ref, ref_offset, event, event_sync = st._share_cuda_()
            out.append(IpcPool(int(g), "cuda", node, _uuid(dev), handle, ref, size, offset, ref_offset,
                               event or b"", bool(event_sync)))
        else:
            manager, name, size = st._share_filename_cpu_()  # moves the storage into /dev/shm, in place
            out.append(IpcPool(int(g), "shm", node, "", name, manager, size, 0, 0, b"", False))
    return tuple(out)


def split_chunks(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, chunk: int) -> np.ndarray:
    """Byte ranges ([N] int64 each) -> [M, 3] int64 (src, dst, length), each at most `chunk`
    bytes, in order: the copy kernel's programs."""
    per = -(-nbytes // chunk)  # [N] chunks per range
    idx = np.repeat(np.arange(len(nbytes)), per)  # [M] range of each chunk
    k = np.arange(len(idx)) - np.repeat(np.cumsum(per) - per, per)  # [M] chunk number within its range
    out = np.empty((len(idx), 3), dtype=np.int64)
    out[:, 0] = src[idx] + k * chunk
    out[:, 1] = dst[idx] + k * chunk
    out[:, 2] = np.minimum(chunk, nbytes[idx] - k * chunk)
    return out


def _groups(addrs: np.ndarray, layouts: tuple[PoolLayout, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Absolute addresses ([N] uint64) -> (page group, byte offset in that group's pool), [N] int64."""
    group = np.full(len(addrs), -1, dtype=np.int64)
    offset = np.zeros(len(addrs), dtype=np.int64)
    for lay in layouts:
        hit = (addrs >= np.uint64(lay.base_addr)) & (addrs < np.uint64(lay.base_addr + lay.nbytes))
        group[hit] = lay.group
        offset[hit] = (addrs[hit] - np.uint64(lay.base_addr)).astype(np.int64)
    assert (group >= 0).all(), "descriptor outside every pool"
    return group, offset


@dataclass(slots=True)
class _PlanCopy:
    """One page group's WritePlan as byte offsets into the two pools (its first layer; layer li is
    shifted by li * stride on each side) and, on GPU, as the copy kernel's chunk table."""

    group: int
    src: np.ndarray  # [N] int64 byte offsets in our pool
    dst: np.ndarray  # [N] int64 byte offsets in the peer's pool
    nbytes: np.ndarray  # [N] int64
    src_stride: int  # bytes per layer
    dst_stride: int
    table: torch.Tensor | None = None  # [M, 3] int64 words (src, dst, length) on our GPU


@dataclass(slots=True)
class IpcWrite:
    """One posted WRITE (the sender's in-flight handle): queued, launched, then notified."""

    remote: str
    notif: bytes
    parts: list[tuple[_PlanCopy, int]]  # (plan, layer) still to launch; [] once launched or copied
    event: Any = None  # torch.cuda.Event of the launch that carried it; None on CPU (copied at once)
    keep: list[torch.Tensor] = field(default_factory=list)  # chunk tables, mapped pools: alive until done
    notified: bool = False


# Copies in flight on the side stream; WRITEs posted meanwhile wait and are merged into the next
# launch. One H200, 32k tokens posted back to back: 1 -> 171 GB/s, 2 -> 134 GB/s (host-bound).
MAX_LAUNCHES = 1
MAX_PLANS = 64  # cached plans (one per request and page group)


class IpcTarget:
    """One decode agent's pools mapped into this process; NixlAgent's write_layers/done/release.

    On GPU, WRITEs posted while MAX_LAUNCHES copies are running are queued and launched together
    (one launch per plan and run of consecutive layers): a prefill that runs ahead, or a backlog,
    costs a few launches instead of one host-side launch (20-100 us) per layer."""

    path = "ipc"

    def __init__(self, nixl: NixlAgent, pool: KVPool, hs: Handshake, device: int | None,
                 stream: Any = None) -> None:
        self._nixl, self._stream = nixl, stream
        self._local_layouts, self._remote_layouts = nixl.layouts, hs.pools
        self._src: dict[int, torch.Tensor] = {}  # group -> flat uint8 view of our pool
        self._dst: dict[int, torch.Tensor] = {}  # group -> flat uint8 view of the peer's pool
        self._plans: OrderedDict[int, tuple[WritePlan, _PlanCopy]] = OrderedDict()  # by id(plan)
        self._queue: list[IpcWrite] = []
        self._running: deque[Any] = deque()  # events of launched copies, oldest first
        for p in hs.ipc:
            if pool.pools[p.group].numel() == 0:
                continue
            self._src[p.group] = pool.pools[p.group].view(-1).view(torch.uint8)
            st = (torch.UntypedStorage._new_shared_cuda(device, p.handle, p.nbytes, p.offset, p.manager, p.ref_offset,
                                                        p.event_handle or None, p.event_sync) if device is not None
                  else torch.UntypedStorage._new_shared_filename_cpu(p.manager, p.handle, p.nbytes))
            self._dst[p.group] = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            if self._dst[p.group].numel() != hs.pool(p.group).nbytes:
                raise TransportError(f"IPC pool of group {p.group} is {p.nbytes} bytes, the handshake says "
                                     f"{hs.pool(p.group).nbytes}")

    def write_layers(self, remote: str, remote_mem_type: str, parts: list[tuple[WritePlan, int]],
                     notif: bytes) -> IpcWrite:
        """NixlAgent.write_layers' contract: layer li of each (plan, li) is copied, then `notif`
        reaches the peer (from done())."""
        h = IpcWrite(remote, notif, [(self._plan(plan), li) for plan, li in parts])
        if self._stream is None:  # host memory: copy now
            for pc, li in h.parts:
                src, dst = self._src[pc.group], self._dst[pc.group]
                for s, d, k in zip((pc.src + li * pc.src_stride).tolist(), (pc.dst + li * pc.dst_stride).tolist(),
                                   pc.nbytes.tolist()):
                    dst[d:d + k].copy_(src[s:s + k])
            h.parts = []
            return h
        self._queue.append(h)
        self._flush()
        return h

    def _plan(self, plan: WritePlan) -> _PlanCopy:
        hit = self._plans.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1]
        sg, so = _groups(plan.src[:, 0], self._local_layouts)
        dg, do = _groups(plan.dst[:, 0], self._remote_layouts)
        assert len(sg) and (sg == sg[0]).all() and (dg == sg).all(), "a plan covers one page group"
        pc = _PlanCopy(int(sg[0]), so, do, plan.src[:, 1].astype(np.int64), plan.src_stride, plan.dst_stride)
        if self._stream is not None:
            from kv_transfer.ipc_kernel import WORD
            chunks = split_chunks(pc.src, pc.dst, pc.nbytes, CHUNK_BYTES)
            assert not (chunks % ALIGN).any() and not (pc.src_stride % ALIGN or pc.dst_stride % ALIGN), \
                "IPC ranges must be 16-byte aligned"
            with torch.cuda.stream(self._stream):
                # pinned: a copy from pageable memory synchronises the stream first (here: waits for the
                # copies still running on it)
                pc.table = torch.from_numpy(chunks // WORD).pin_memory().to(self._src[pc.group].device,
                                                                            non_blocking=True)
        self._plans[id(plan)] = (plan, pc)  # the plan is kept, so its id is not reused while cached
        while len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return pc

    def _flush(self) -> None:
        """Launch every queued WRITE as one batch, unless MAX_LAUNCHES copies are still running."""
        while self._running and self._running[0].query():
            self._running.popleft()
        if not self._queue or len(self._running) >= MAX_LAUNCHES:
            return
        from kv_transfer.ipc_kernel import WORD, copy_chunks
        batch, self._queue = self._queue, []
        layers: dict[int, tuple[_PlanCopy, set[int]]] = {}
        for h in batch:
            for pc, li in h.parts:
                layers.setdefault(id(pc), (pc, set()))[1].add(li)
        keep = []
        try:
            with torch.cuda.stream(self._stream):
                for pc, lis in layers.values():
                    src, dst = self._src[pc.group].view(torch.int64), self._dst[pc.group].view(torch.int64)
                    for li0, n in _runs(sorted(lis)):
                        copy_chunks(src, dst, pc.table, CHUNK_BYTES // WORD, li0, n, pc.src_stride // WORD,
                                    pc.dst_stride // WORD)
                    keep += [pc.table, dst]
            event = torch.cuda.Event()
            event.record(self._stream)
        except RuntimeError as e:  # a CUDA error: this peer's path is unusable
            self._queue = batch + self._queue  # still releasable by their owners
            raise TransportError(f"IPC copy to {batch[0].remote} failed: {e}") from e
        for h in batch:
            h.parts, h.event, h.keep = [], event, keep
        self._running.append(event)

    def done(self, h: IpcWrite) -> bool:
        self._flush()
        if h.parts or (h.event is not None and not h.event.query()):
            return False
        if not h.notified:
            h.notified = True
            self._nixl.send_notif(h.remote, h.notif)  # PeerGone / TransportError: decode is gone
        return True

    def release(self, h: IpcWrite) -> bool:
        """A launched copy cannot be cancelled: False until it completed. A queued one is dropped."""
        if h.parts:
            self._queue.remove(h)
            h.parts = []
            return True
        if h.event is not None and not h.event.query():
            return False
        h.keep = []
        return True


def _runs(layers: list[int]) -> list[tuple[int, int]]:
    """Ascending layer indices -> (first, count) of each run of consecutive ones."""
    out: list[tuple[int, int]] = []
    for li in layers:
        if out and out[-1][0] + out[-1][1] == li:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((li, 1))
    return out


class IpcPaths:
    """Prefill side: which data path each decode agent gets, with its mapping cached by agent name."""

    def __init__(self, nixl: NixlAgent, pool: KVPool) -> None:
        self._nixl, self._pool = nixl, pool
        self._targets: dict[str, IpcTarget | None] = {}
        dev = pool.pools[0].device
        self._device = int(dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else None
        self._stream = torch.cuda.Stream(self._device) if self._device is not None else None
        self._node = node_id()

    def target(self, hs: Handshake) -> IpcTarget | None:
        """The mapped peer, or None for NIXL WRITEs; decided once per decode agent."""
        if hs.agent_name in self._targets:
            return self._targets[hs.agent_name]
        why, peer_dev = self._unusable(hs)
        tgt = None
        if not why:
            try:
                if peer_dev is not None and peer_dev != self._device:  # torch enables peer access on a P2P copy
                    torch.empty(1, device=f"cuda:{peer_dev}").copy_(torch.empty(1, device=f"cuda:{self._device}"))
                tgt = IpcTarget(self._nixl, self._pool, hs, peer_dev, self._stream)
            except (RuntimeError, OSError, TransportError) as e:
                why = f"mapping its pools failed: {e}"
        log.info("kv sender %s -> %s: data path %s%s", self._nixl.name, hs.agent_name, "ipc" if tgt else "nixl",
                 f" ({why})" if why else "")
        self._targets[hs.agent_name] = tgt
        return tgt

    def _unusable(self, hs: Handshake) -> tuple[str, int | None]:
        """Why `hs`'s export cannot be used from here ('' if it can), and the peer's local device index."""
        if not hs.ipc:
            return "the decode rank exported no pools", None
        if any(p.node_id != self._node for p in hs.ipc):
            return "the decode rank runs on another node", None
        groups = {int(g) for g in PageGroup if self._pool.pools[g].numel()}
        if not groups <= {p.group for p in hs.ipc}:
            return "the decode rank exported too few pools", None
        if self._device is None:
            return ("", None) if all(p.kind == "shm" for p in hs.ipc) else ("decode pools are not host memory", None)
        if any(p.kind != "cuda" for p in hs.ipc) or len({p.device_uuid for p in hs.ipc}) != 1:
            return "decode pools are not on one GPU", None
        peer = next((i for i in range(torch.cuda.device_count()) if _uuid(i) == hs.ipc[0].device_uuid), None)
        if peer is None:
            return "the decode GPU is not visible to this process", None
        if peer != self._device and not torch.cuda.can_device_access_peer(self._device, peer):
            return f"GPU {self._device} cannot access GPU {peer}", None
        spec = self._pool.spec
        if spec.page_size * spec.head_dim * self._pool.pools[0].element_size() % ALIGN:
            return f"a head's bytes are not a multiple of {ALIGN}", None
        return "", peer

    def forget(self, agent_name: str) -> None:
        """The agent was removed or replaced: unmap (in-flight copies keep their own references)."""
        self._targets.pop(agent_name, None)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._targets.clear()
