"""kv_transfer.ipc on CPU, in one process: chunking, the in-place shared-memory export (views stay
valid), copies through a mapped pool from the plan's own descriptors, the per-peer choice of data
path, and the flags that select it. Two real processes: tests/integration/test_kv_transfer_nixl.py."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from common.errors import ConfigError
from kv_transfer import ipc
from kv_transfer.factory import TransferBackend
from kv_transfer.interface import TransferConfig
from kv_transfer.messages import Handshake, KVCompat, PoolLayout
from kv_transfer.nixl_backend import descriptors
from kv_transfer.plan import GroupGeometry, WritePlan, head_runs, layer_copies, page_pairs
from model.kv_cache import KVManager, KVPool, PageGroup
from tests.unit.test_kv_transfer_loopback import random_pool, scattered_pages, spec_for


@pytest.mark.parametrize("seed", range(5))
def test_split_chunks_covers_every_range_in_order(seed):
    rng = np.random.default_rng(seed)
    n = rng.integers(1, 40)
    nbytes = rng.integers(1, 200, n) * 16
    src, dst = np.cumsum(nbytes) - nbytes, rng.permutation(n) * 10_000
    chunks = ipc.split_chunks(src, dst, nbytes, 64)
    assert (chunks[:, 2] > 0).all() and (chunks[:, 2] <= 64).all()
    assert chunks[:, 2].sum() == nbytes.sum()
    want = np.concatenate([np.stack([s + np.arange(0, k, 64), d + np.arange(0, k, 64)], 1)
                           for s, d, k in zip(src, dst, nbytes)])
    assert np.array_equal(chunks[:, :2], want)


def test_runs_of_consecutive_layers():
    assert ipc._runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 1), (7, 2)] and ipc._runs([]) == []


def test_cpu_export_moves_pools_into_shared_memory_in_place():
    spec = spec_for(1)
    pool = random_pool(spec, 3)
    before = [p.clone() for p in pool.pools]
    tensors = list(pool.pools)
    k, v = pool.layer_kv(1)  # views held elsewhere (the model's layer caches) before the export
    exported = ipc.export_pools(pool)
    assert [p.group for p in exported] == [int(g) for g in PageGroup]
    assert all(p.kind == "shm" and p.node_id == ipc.node_id() and p.nbytes == t.numel() * t.element_size()
               for p, t in zip(exported, pool.pools))
    assert all(a is b and a.is_shared() for a, b in zip(pool.pools, tensors))  # same tensor objects
    assert all(torch.equal(a, b) for a, b in zip(pool.pools, before))  # contents moved along
    k.fill_(7.0)  # a view taken before still aliases the (moved) pool
    g, li = spec.group_of(1)
    assert (pool.pools[g][li, 0] == 7.0).all() and k.data_ptr() == pool.pools[g][li, 0].data_ptr()
    assert ipc.export_pools(pool) == exported  # exporting again names the same shared memory


class FakeAgent:
    """What IpcPaths/IpcTarget use of NixlAgent: its name, registered layouts, notifications."""

    path = "nixl"

    def __init__(self, pool: KVPool) -> None:
        self.name = "pre/prefill/0/1"
        self.layouts = _layouts(pool)
        self.sent: list[tuple[str, bytes]] = []

    def send_notif(self, remote: str, msg: bytes) -> None:
        self.sent.append((remote, msg))


def _layouts(pool: KVPool) -> tuple[PoolLayout, ...]:
    return tuple(PoolLayout(int(g), t.data_ptr(), t.numel() * t.element_size(), 0, pool.spec.num_pages[g])
                 for g, t in zip(PageGroup, pool.pools) if t.numel())


def _handshake(pool: KVPool, exported) -> Handshake:
    compat = KVCompat.from_spec(pool.spec, "m", 1)
    return Handshake("dec", "dec/decode/0/9", b"md", 9, 0, 1, "DRAM", pool.spec.num_kv_heads, _layouts(pool), compat,
                     compat.digest(), exported)


def test_ipc_target_copies_plan_descriptors_into_the_mapped_pool():
    spec, n_tokens = spec_for(1), 100
    src, dst = random_pool(spec, 5), KVPool(spec)
    hs = _handshake(dst, ipc.export_pools(dst))  # base addresses after the export, as the receiver sends them
    agent = FakeAgent(src)
    paths = ipc.IpcPaths(agent, src)
    target = paths.target(hs)
    assert target is not None and paths.target(hs) is target  # mapped once per agent
    spages = scattered_pages(KVManager(spec), n_tokens, seed=1)
    dpages = scattered_pages(KVManager(spec), n_tokens, seed=2)
    parts = []
    for g in PageGroup:  # one WRITE of every layer of both groups, planned as NixlSender plans it
        geo = GroupGeometry(len(spec.layers(g)), spec.num_pages[g], spec.num_kv_heads, spec.page_size, spec.head_dim, 4)
        pairs = page_pairs(g, spages, dpages, n_tokens, spec.page_size, spec.sliding_window, spec.num_pages[g],
                           spec.num_pages[g])
        cp = layer_copies(geo, geo, 0, pairs, head_runs(spec.num_kv_heads, 0, 1, 1)[0])
        stride = 2 * geo.num_pages * geo.page_bytes
        plan = WritePlan(descriptors(agent.layouts[g].base_addr, cp.src, cp.nbytes, 0),
                         descriptors(hs.pool(g).base_addr, cp.dst, cp.nbytes, 0), stride, stride, cp.total_bytes)
        parts += [(plan, li) for li in range(geo.num_layers)]
    h = target.write_layers(hs.agent_name, "DRAM", parts, b"layers")
    assert target.done(h) and target.done(h) and target.release(h)
    assert agent.sent == [(hs.agent_name, b"layers")]  # once, after the data
    for g in PageGroup:
        r = -(-spec.sliding_window // spec.page_size) + 1
        js = range(0, -(-n_tokens // spec.page_size)) if g == PageGroup.FULL else \
            range(max(0, n_tokens - spec.sliding_window + 1) // spec.page_size, -(-n_tokens // spec.page_size))
        sp = [spages.full[j] if g == PageGroup.FULL else spages.ring[j % r] for j in js]
        dp = [dpages.full[j] if g == PageGroup.FULL else dpages.ring[j % r] for j in js]
        assert torch.equal(dst.pools[g][:, :, dp], src.pools[g][:, :, sp])
        untouched = sorted(set(range(spec.num_pages[g])) - set(dp))
        assert dst.pools[g][:, :, untouched].abs().sum() == 0
    paths.forget(hs.agent_name)
    assert paths.target(hs) is not target  # mapped again after the agent was removed
    paths.close()


def test_ipc_paths_fall_back_to_nixl_and_say_why(caplog):
    spec = spec_for(1)
    src, dst = random_pool(spec, 5), KVPool(spec)
    exported = ipc.export_pools(dst)
    paths = ipc.IpcPaths(FakeAgent(src), src)
    caplog.set_level(logging.INFO, logger="kv_transfer.ipc")
    assert paths.target(_handshake(dst, ())) is None
    other = tuple(dataclasses.replace(p, node_id="elsewhere") for p in exported)
    assert paths.target(dataclasses.replace(_handshake(dst, other), agent_name="dec/decode/0/10")) is None
    logs = [r.getMessage() for r in caplog.records]
    assert any("data path nixl (the decode rank exported no pools)" in m for m in logs), logs
    assert any("data path nixl (the decode rank runs on another node)" in m for m in logs), logs


def test_unknown_data_path_is_a_config_error():
    from kv_transfer.nixl_receiver import NixlReceiver
    from kv_transfer.nixl_sender import NixlSender
    for cls in (NixlSender, NixlReceiver):
        with pytest.raises(ConfigError, match="data path 'rdma'"):
            cls(KVPool(spec_for(1)), TransferConfig("x", "m"), data_path="rdma")


def test_ipc_is_selectable_end_to_end():
    import argparse

    from engine.worker_args import add_worker_args
    from launcher.ray_launch import build_parser, fleet_spec
    assert TransferBackend("ipc") == TransferBackend.IPC
    p = argparse.ArgumentParser()
    add_worker_args(p, port=1, metrics_port=2)
    assert p.parse_args(["--kv-backend", "ipc"]).kv_backend == "ipc"
    spec = fleet_spec(build_parser().parse_args(["--kv-backend", "ipc"]), "/c")
    for flags in (spec.prefill_flags, spec.decode_flags):
        assert flags[flags.index("--kv-backend") + 1] == "ipc"
