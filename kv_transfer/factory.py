"""Backend selection, once at worker start-up: TransferBackend -> a KVSender / KVReceiver.

Imports are lazy so that a process using the loopback backend never loads NIXL (and a CPU-only
machine without UCX transports can still run colocated tests). The caller logs the choice.
"""

from __future__ import annotations

from enum import Enum

from common.errors import ConfigError
from kv_transfer.interface import KVReceiver, KVSender, TransferConfig
from model.kv_cache import KVPool


class TransferBackend(str, Enum):
    NIXL = "nixl"  # UCX: NVLink / RDMA between GPUs, TCP between hosts without them
    # NIXL control plane, same-node data path through shared/IPC-mapped pools (CUDA IPC on GPU,
    # shared memory on CPU); peers on other nodes get NIXL WRITEs (kv_transfer/ipc.py)
    IPC = "ipc"
    LOOPBACK = "loopback"  # same process (colocated prefill and decode, unit tests)


def create_sender(backend: TransferBackend | str, pool: KVPool, config: TransferConfig) -> KVSender:
    kind = _parse(backend)
    if kind in (TransferBackend.NIXL, TransferBackend.IPC):
        from kv_transfer.nixl_sender import NixlSender
        return NixlSender(pool, config, data_path=kind.value)
    from kv_transfer.loopback import LoopbackSender
    return LoopbackSender(pool, config)


def create_receiver(backend: TransferBackend | str, pool: KVPool, config: TransferConfig) -> KVReceiver:
    kind = _parse(backend)
    if kind in (TransferBackend.NIXL, TransferBackend.IPC):
        from kv_transfer.nixl_receiver import NixlReceiver
        return NixlReceiver(pool, config, data_path=kind.value)
    from kv_transfer.loopback import LoopbackReceiver
    return LoopbackReceiver(pool, config)


def _parse(backend: TransferBackend | str) -> TransferBackend:
    try:
        return TransferBackend(backend)
    except ValueError as e:
        raise ConfigError(f"unknown KV transfer backend {backend!r}; choose one of "
                          f"{[b.value for b in TransferBackend]}") from e
