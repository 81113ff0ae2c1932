"""NIXL plumbing shared by NixlSender and NixlReceiver: one NIXL agent per worker rank with the KV
pools registered once, WRITEs from byte-range plans, notifications; and the ZMQ side channel.

Lifecycle: a worker rank builds its KVPool, then one NixlAgent over it (registration happens here,
once, for the whole pool tensor of each page group; DRAM or VRAM from the tensor's device, same
code). Remote agents are added from handshake/claim metadata and removed when their epoch is over.
Transfers are posted without blocking; `state()` maps NIXL's view of a WRITE onto done / in flight
/ PeerGone / TransportError. `close()` deregisters.

The side channel is ZMQ: each decode rank binds a ROUTER; each prefill rank connects one DEALER per
decode rank, with its agent name as routing id so decode can send Cancel back. All sends are
non-blocking and all receives are polled with timeout 0: deadlines are enforced by the callers'
state machines, never by blocking here.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import zmq

from common.errors import ConfigError
from kv_transfer.messages import MAX_MESSAGE_BYTES, PoolLayout
from kv_transfer.plan import WritePlan
from model.kv_cache import KVPool, PageGroup

log = logging.getLogger(__name__)


class PeerGone(Exception):
    """NIXL reports the remote agent disconnected: its process (epoch) is gone."""


class TransportError(Exception):
    """Any other NIXL failure of a transfer or notification."""


def _nixl() -> tuple[Any, Any]:
    try:
        import nixl._api as api
        import nixl._bindings as bindings
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ConfigError("NIXL is not installed: install nixl-cu13 and the `nixl` shim (--no-deps)") from e
    return api, bindings


class NixlAgent:
    """One NIXL agent with a KVPool registered. Addresses in descriptors are absolute."""

    path = "nixl"  # the data path its write() takes (kv_transfer/ipc.py's IpcTarget has the same API)

    def __init__(self, name: str, pool: KVPool, backends: tuple[str, ...] = ("UCX",)) -> None:
        api, self._b = _nixl()
        self._errors = tuple(getattr(self._b, n) for n in dir(self._b) if n.startswith("nixl") and n.endswith("Error"))
        self.name = name
        # NIXL's progress thread spins (~0.8 of a core per agent on the CPU machine), but without it a
        # sender whose peer died was seen to block in the full suite: keep it on everywhere.
        prog_thread = True
        try:
            self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=prog_thread,
                                                                     backends=list(backends)))
        except self._errors as e:
            raise ConfigError(f"NIXL agent {name} could not start its backends {backends}: {e}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise ConfigError(f"NIXL backend(s) {missing} could not be created (UCX over TCP needs "
                              "UCX_TLS=tcp on hosts without RDMA/NVLink)")
        dev = pool.pools[0].device
        self.mem_type = "VRAM" if dev.type == "cuda" else "DRAM"
        self.device_id = int(dev.index or 0) if dev.type == "cuda" else 0
        self._regs = []
        layouts = []
        for g in PageGroup:
            t = pool.pools[g]
            if t.numel() == 0:
                continue
            assert t.is_contiguous() and t.device == dev
            self._regs.append(self._agent.register_memory(t))  # the whole pool, once
            layouts.append(PoolLayout(int(g), t.data_ptr(), t.numel() * t.element_size(), self.device_id,
                                      pool.spec.num_pages[g]))
        self.layouts = tuple(layouts)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        try:
            return self._agent.add_remote_agent(metadata)
        except self._errors as e:
            raise TransportError(f"cannot load remote agent metadata: {e}") from e

    def remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except self._errors as e:
            log.info("remove_remote_agent(%s): %s", name, e)

    def write(self, remote: str, remote_mem_type: str, local: np.ndarray, remote_descs: np.ndarray,
              notif: bytes) -> Any:
        """Post one WRITE of local[i] -> remote_descs[i] (each [N, 3] uint64: address, length,
        device id); `notif` reaches the remote agent after the data. Returns the handle."""
        try:
            h = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, self.mem_type),
                                            self._agent.get_xfer_descs(remote_descs, remote_mem_type), remote, notif)
            state = self._agent.transfer(h)
        except self._b.nixlRemoteDisconnectError as e:
            raise PeerGone(f"{remote} disconnected") from e
        except self._errors as e:
            raise TransportError(f"WRITE to {remote} failed to post: {type(e).__name__} {e}") from e
        if state == "ERR":
            self.release(h)
            raise TransportError(f"WRITE to {remote} failed to post")
        return h

    def write_layers(self, remote: str, remote_mem_type: str, parts: list[tuple[WritePlan, int]],
                     notif: bytes) -> Any:
        """One WRITE of layer `li` of each (plan, li) in `parts` (kv_transfer/plan.py)."""
        srcs, dsts = zip(*(plan.layer(li) for plan, li in parts))
        return self.write(remote, remote_mem_type, np.concatenate(srcs), np.concatenate(dsts), notif)

    def done(self, handle: Any) -> bool:
        """True once the WRITE completed (data placed remotely), False while in flight."""
        try:
            state = self._agent.check_xfer_state(handle)
        except self._b.nixlRemoteDisconnectError as e:
            raise PeerGone("remote agent disconnected during a WRITE") from e
        except self._errors as e:
            raise TransportError(f"WRITE failed: {type(e).__name__} {e}") from e
        if state == "ERR":
            raise TransportError("WRITE reported an error")
        return state == "DONE"

    def release(self, handle: Any) -> bool:
        """Free a handle; an active WRITE is cancelled if the backend can. False: still active."""
        try:
            handle.release()
            return True
        except self._errors as e:
            log.debug("release of an active WRITE deferred: %s", e)
            return False

    def notifs(self) -> dict[str, list[bytes]]:
        return self._agent.get_new_notifs()

    def send_notif(self, remote: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(remote, msg)
        except self._b.nixlRemoteDisconnectError as e:
            raise PeerGone(f"{remote} disconnected") from e
        except self._errors as e:
            raise TransportError(f"notification to {remote} failed: {type(e).__name__} {e}") from e

    def close(self) -> None:
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except self._errors as e:
                log.warning("deregister_memory: %s", e)
        self._regs = []


def descriptors(base: int, offsets: np.ndarray, nbytes: np.ndarray, device_id: int) -> np.ndarray:
    """[N, 3] uint64 NIXL descriptors (address, length, device id)."""
    out = np.empty((len(offsets), 3), dtype=np.uint64)
    out[:, 0] = base + offsets
    out[:, 1] = nbytes
    out[:, 2] = device_id
    return out


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # larger frames drop the connection
    s.setsockopt(zmq.SNDHWM, 10000)
    s.setsockopt(zmq.RCVHWM, 10000)
    return s


class SideChannelServer:
    """A decode rank's ROUTER: receives (peer routing id, bytes), replies by routing id."""

    def __init__(self, ctx: zmq.Context, host: str, port: int) -> None:
        self._sock = _socket(ctx, zmq.ROUTER)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
            else:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ConfigError(f"cannot bind the KV side channel on {host}:{port}: {e}") from e
        self.endpoint = f"tcp://{host}:{port}"

    def recv_all(self, limit: int = 1024) -> list[tuple[bytes, bytes]]:
        out = []
        while len(out) < limit:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 2:
                out.append((frames[0], frames[1]))
        return out

    def send(self, peer: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([peer, data], zmq.NOBLOCK)
        except zmq.Again:  # peer gone or not draining: it learns the outcome from its own deadline
            log.warning("side channel: dropped a message to %r", peer)

    def close(self) -> None:
        self._sock.close(linger=0)


class SideChannelClient:
    """A prefill rank's DEALER to one decode rank."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: str) -> None:
        self.endpoint = endpoint
        self._sock = _socket(ctx, zmq.DEALER)
        self._sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            raise

    def send(self, data: bytes) -> None:
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("side channel: dropped a message to %s", self.endpoint)

    def recv_all(self, limit: int = 1024) -> list[bytes]:
        out = []
        while len(out) < limit:
            try:
                out.append(self._sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
