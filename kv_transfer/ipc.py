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
A WRITE step: the sender hands us the same NIXL descriptors it would post (absolute addresses in
each side's address space, made from kv_transfer/plan.py); `IpcTarget` subtracts the pool bases
(ours from NixlAgent.layouts, the peer's from its Handshake) to get byte offsets per page group.
  CUDA: ranges are split into 16 KiB chunks on the host (numpy) and copied by one Triton launch
        per page group on a side stream, then an event is recorded: the WRITE's handle. The
        layers' completion events were waited for before the sender calls us.
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kv_transfer.messages import Handshake, IpcPool, PoolLayout
from kv_transfer.nixl_backend import NixlAgent, TransportError
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
class IpcWrite:
    """One posted copy (the sender's in-flight handle)."""

    remote: str
    notif: bytes
    event: Any = None  # torch.cuda.Event on GPU; None: the copy already happened (CPU)
    keep: list[torch.Tensor] = field(default_factory=list)  # chunk tables, mapped pools: alive until done
    notified: bool = False


class IpcTarget:
    """One decode agent's pools mapped into this process; writes with NixlAgent's signature."""

    path = "ipc"

    def __init__(self, nixl: NixlAgent, pool: KVPool, hs: Handshake, device: int | None,
                 stream: Any = None) -> None:
        self._nixl, self._stream = nixl, stream
        self._local_layouts, self._remote_layouts = nixl.layouts, hs.pools
        self._src: dict[int, torch.Tensor] = {}  # group -> flat uint8 view of our pool
        self._dst: dict[int, torch.Tensor] = {}  # group -> flat uint8 view of the peer's pool
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

    def write(self, remote: str, remote_mem_type: str, local: np.ndarray, remote_descs: np.ndarray,
              notif: bytes) -> IpcWrite:
        """Same contract as NixlAgent.write: local[i] -> remote_descs[i] ([N, 3] uint64: address,
        length, device id), `notif` reaches the peer after the data (from done())."""
        sg, so = _groups(local[:, 0], self._local_layouts)
        dg, do = _groups(remote_descs[:, 0], self._remote_layouts)
        assert (sg == dg).all(), "a descriptor crosses page groups"
        n = local[:, 1].astype(np.int64)
        h = IpcWrite(remote, notif)
        try:
            for g in np.unique(sg).tolist():
                m = sg == g
                if self._stream is None:
                    src, dst = self._src[g], self._dst[g]
                    for s, d, k in zip(so[m].tolist(), do[m].tolist(), n[m].tolist()):
                        dst[d:d + k].copy_(src[s:s + k])
                else:
                    h.keep += self._launch(g, split_chunks(so[m], do[m], n[m], CHUNK_BYTES))
            if self._stream is not None:
                h.event = torch.cuda.Event()
                h.event.record(self._stream)
        except RuntimeError as e:  # a CUDA error: this peer's path is unusable
            raise TransportError(f"IPC copy to {remote} failed: {e}") from e
        return h

    def _launch(self, g: int, table: np.ndarray) -> list[torch.Tensor]:
        from kv_transfer.ipc_kernel import WORD, copy_chunks
        assert not (table % ALIGN).any(), "IPC ranges must be 16-byte aligned"
        src, dst = self._src[g].view(torch.int64), self._dst[g].view(torch.int64)
        with torch.cuda.stream(self._stream):
            words = torch.from_numpy(table // WORD).to(src.device, non_blocking=True)  # [M, 3]
            copy_chunks(src, dst, words, CHUNK_BYTES // WORD)
        return [words, dst]

    def done(self, h: IpcWrite) -> bool:
        if h.event is not None and not h.event.query():
            return False
        if not h.notified:
            h.notified = True
            self._nixl.send_notif(h.remote, h.notif)  # PeerGone / TransportError: decode is gone
        return True

    def release(self, h: IpcWrite) -> bool:
        """A running copy cannot be cancelled: False until it completed."""
        if h.event is not None and not h.event.query():
            return False
        h.keep.clear()
        return True


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
