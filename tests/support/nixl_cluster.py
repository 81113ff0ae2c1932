"""The harness of the NIXL KV-transfer tests (tests/integration/test_kv_transfer_nixl.py, and its GPU
sibling test_kv_transfer_ipc_gpu.py): a Scenario, the prefill/decode child processes (one per rank,
started with `spawn`, so they must live in an importable module), and the Cluster that wires them."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from dataclasses import dataclass, field

import torch

from kv_transfer.interface import TransferConfig, TransferStatus
from kv_transfer.messages import TransferRequest, decode, encode
from model.kv_cache import KV_DTYPES, KVManager, KVPool, PageGroup
from tests.unit.test_kv_transfer_loopback import (LAYERS, dst_block, expected_block, random_pool, scattered_pages,
                                                  spec_for)

WAIT = 120.0  # generous: a loaded 2-core CI machine starts NIXL agents slowly


@dataclass(frozen=True)
class Scenario:
    p: int = 1
    d: int = 1
    n_tokens: int = 100
    deadline_s: float = 20.0
    pause_after: int | None = None  # prefill stops after this layer until told "go"
    prefill_page_size: int = 8
    restart_decode: bool = False  # decode re-creates its receiver (new epoch) after issuing the request
    abort_after_first_layer: bool = False  # decode aborts once a layer has landed
    check_partial: bool = False  # decode checks layer-by-layer landing while prefill is paused
    data_path: str = "nixl"  # both sides: "nixl" | "ipc"
    devices: tuple[str, str] = ("cpu", "cpu")  # prefill, decode pools
    decode_node: str = ""  # decode exports its pools under this node id (a fake other node)
    kv_dtypes: tuple[str, str] = ("fp32", "fp32")  # prefill, decode pools (model.kv_cache.KV_DTYPES)


@dataclass
class Result:
    role: str
    rank: int
    status: str
    reason: str | None
    detail: str = ""
    num_bytes: int = 0
    seconds_to_terminal: float = 0.0  # from the start of polling
    seconds_to_pages_free: float = 0.0
    data_ok: bool | None = None
    partial_ok: bool | None = None
    all_free: bool = False
    notes: list[str] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)  # prefill: decode agent -> data path used


def _get(q, kind: str, timeout: float = WAIT):
    end = time.monotonic() + timeout
    while True:
        msg = q.get(timeout=max(0.01, end - time.monotonic()))
        if msg[0] == kind:
            return msg
        raise AssertionError(f"expected {kind}, got {msg[0]}")


def _ctl(q) -> str | None:
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


# ---- child processes -------------------------------------------------------------------------------
def _device(dev: str) -> str:
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    return dev


def decode_main(rank: int, sc: Scenario, ctl, out) -> None:
    from kv_transfer import ipc
    from kv_transfer.nixl_receiver import NixlReceiver
    if sc.decode_node:
        ipc.node_id = lambda: sc.decode_node
    spec = spec_for(sc.d, dtype=KV_DTYPES[sc.kv_dtypes[1]])
    pool, kv = KVPool(spec, _device(sc.devices[1])), KVManager(spec)
    cfg = TransferConfig("dec", "m", rank, sc.d, probe_interval_s=0.1)
    rx = NixlReceiver(pool, cfg, data_path=sc.data_path)
    out.put(("addr", rank, rx.endpoint, rx.epoch))
    _, endpoints, epochs = ctl.get(timeout=WAIT)
    if sc.d > 1:
        rx.set_rank_endpoints(endpoints, epochs)
    pages = scattered_pages(kv, sc.n_tokens, seed=11)  # the same ids on every decode rank
    req = rx.expect("q", pages, sc.n_tokens, time.time() + sc.deadline_s)
    if sc.restart_decode:  # the worker restarts: same address, new epoch, same request id re-admitted
        rx.close()
        rx = NixlReceiver(pool, TransferConfig("dec", "m", rank, sc.d, port=int(endpoints[rank].rsplit(":", 1)[1])),
                          data_path=sc.data_path)
        rx.expect("q", pages, sc.n_tokens, time.time() + 3.0)
    out.put(("req", rank, encode(req)))
    res = Result("decode", rank, "", None)
    src = [random_pool(spec_for(sc.p, dtype=KV_DTYPES[sc.kv_dtypes[0]]), 100 + r) for r in range(sc.p)]
    t0 = time.monotonic()
    while not rx.poll("q").terminal and time.monotonic() - t0 < WAIT:
        if sc.abort_after_first_layer and rx.outcome("q").num_bytes > 0:
            rx.abort("q", detail="client went away")
        if sc.check_partial and _ctl(ctl) == "check":
            res.partial_ok = _check_partial(pool, pages, src, sc, rank, rx)
            out.put(("checked", rank))
        time.sleep(0.002)
    res.seconds_to_terminal = time.monotonic() - t0
    o = rx.outcome("q")
    res.status, res.reason, res.detail, res.num_bytes = o.status.name, o.reason and o.reason.name, o.detail, o.num_bytes
    if o.status == TransferStatus.DONE:
        res.data_ok = all(torch.equal(dst_block(pool, pages, layer, js).cpu(), want) for layer in LAYERS
                          for want, js in [expected_block(src, pages_src(sc), sc.d, rank, layer, spec_for(sc.p),
                                                          sc.n_tokens, sc.p)])
        r = -(-spec.sliding_window // spec.page_size) + 1
        tail = {j % r for j in range(max(0, sc.n_tokens - spec.sliding_window + 1) // spec.page_size,
                                     -(-sc.n_tokens // spec.page_size))}
        untouched = [pg for i, pg in enumerate(pages.ring) if i not in tail]
        res.data_ok = res.data_ok and not any(pool.pools[PageGroup.SLIDING][:, :, pg].view(torch.uint8).any()
                                              for pg in untouched)
        res.notes.append(f"untouched ring pages: {len(untouched)}")
        rx.finish("q")
        kv.release(pages)
    else:
        res.data_ok = not sc.restart_decode or all(p.abs().sum() == 0 for p in pool.pools)
        while time.monotonic() - t0 < WAIT:
            rel = rx.take_releasable()
            for r_ in rel:
                kv.release(r_.pages)
            if rel:
                break
            rx.progress()
            time.sleep(0.005)
        res.seconds_to_pages_free = time.monotonic() - t0
    res.all_free = kv.num_free() == tuple(spec.num_pages)
    out.put(("result", rank, res))
    time.sleep(0.3)  # let the last side-channel messages go out
    rx.close()


def pages_src(sc: Scenario):
    kv = KVManager(spec_for(sc.p, page=sc.prefill_page_size))
    return scattered_pages(kv, sc.n_tokens, seed=7)


def _check_partial(pool, pages, src, sc, rank, rx) -> bool:
    """While prefill is paused after layer `pause_after`: those layers have landed, later ones not."""
    end = time.monotonic() + 10
    done = [layer for layer in LAYERS if layer <= sc.pause_after]
    while time.monotonic() < end:
        rx.progress()
        if all(torch.equal(dst_block(pool, pages, layer, js).cpu(), want) for layer in done
               for want, js in [expected_block(src, pages_src(sc), sc.d, rank, layer, spec_for(sc.p), sc.n_tokens,
                                               sc.p)]):
            break
        time.sleep(0.005)
    else:
        return False
    later = [layer for layer in LAYERS if layer > sc.pause_after]
    zero = all(dst_block(pool, pages, layer, js).abs().sum() == 0 for layer in later
               for _, js in [expected_block(src, pages_src(sc), sc.d, rank, layer, spec_for(sc.p), sc.n_tokens, sc.p)])
    return zero and rx.poll("q") == TransferStatus.TRANSFERRING


def prefill_main(rank: int, sc: Scenario, ctl, out) -> None:
    from kv_transfer.nixl_sender import NixlSender
    spec = spec_for(sc.p, page=sc.prefill_page_size, dtype=KV_DTYPES[sc.kv_dtypes[0]])
    pool = KVPool(spec, _device(sc.devices[0]))
    for dst, src in zip(pool.pools, random_pool(spec, 100 + rank).pools):
        dst.copy_(src)
    kv = KVManager(spec)
    pages = scattered_pages(kv, sc.n_tokens, seed=7)
    tx = NixlSender(pool, TransferConfig("pre", "m", rank, sc.p), data_path=sc.data_path)
    out.put(("ready", rank))
    req = decode(ctl.get(timeout=WAIT), TransferRequest)
    t0 = time.monotonic()
    tx.start(req, pages)
    for layer in LAYERS:
        tx.layer_done(layer)
        if layer == sc.pause_after:
            out.put(("paused", rank))
            while _ctl(ctl) != "go":  # a killed decode or a deadline may happen meanwhile
                tx.progress()
                time.sleep(0.005)
    while not tx.poll("q").terminal and time.monotonic() - t0 < WAIT:
        time.sleep(0.002)
    o = tx.finish("q")
    kv.release(pages)  # the owner frees its source pages once the status is terminal
    res = Result("prefill", rank, o.status.name, o.reason and o.reason.name, o.detail, o.num_bytes,
                 time.monotonic() - t0, all_free=kv.num_free() == tuple(spec.num_pages), paths=dict(tx.data_paths))
    out.put(("result", rank, res))
    t_end = time.monotonic() + 0.5
    while time.monotonic() < t_end:  # keep draining so decode hears our Ended
        tx.progress()
        time.sleep(0.01)
    tx.close()


# ---- harness -----------------------------------------------------------------------------------------
class Cluster:
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        self.ctx = mp.get_context("spawn")
        # One output queue per process: a queue's writers share a lock, and a writer SIGKILLed while
        # holding it (the fault tests kill processes) would block every other writer forever.
        self.outs = [self.ctx.Queue() for _ in range(sc.d + sc.p)]
        self.dctl = [self.ctx.Queue() for _ in range(sc.d)]
        self.pctl = [self.ctx.Queue() for _ in range(sc.p)]
        self.dec = [self.ctx.Process(target=decode_main, args=(s, sc, self.dctl[s], self.outs[s]), daemon=True)
                    for s in range(sc.d)]
        self.pre = [self.ctx.Process(target=prefill_main, args=(r, sc, self.pctl[r], self.outs[sc.d + r]),
                                     daemon=True) for r in range(sc.p)]
        self.msgs: list[tuple] = []

    def __enter__(self) -> Cluster:
        for proc in self.dec + self.pre:
            proc.start()
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.dec + self.pre:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()

    def expect(self, kind: str, n: int = 1, timeout: float = WAIT) -> list[tuple]:
        got, end = [], time.monotonic() + timeout
        while len(got) < n:
            pending = [m for m in self.msgs if m[0] == kind]
            if pending:
                self.msgs.remove(pending[0])
                got.append(pending[0])
                continue
            self.msgs += self._poll(end)
        return got

    def _poll(self, end: float) -> list[tuple]:
        """Whatever any process has sent; raises queue.Empty at `end`."""
        while True:
            got = []
            for q in self.outs:
                try:
                    got.append(q.get_nowait())
                except queue.Empty:
                    pass
            if got:
                return got
            if time.monotonic() > end:
                raise queue.Empty
            time.sleep(0.005)

    def wire(self) -> None:
        addrs = sorted(self.expect("addr", self.sc.d))
        endpoints, epochs = tuple(a[2] for a in addrs), tuple(a[3] for a in addrs)
        for q in self.dctl:
            q.put(("addrs", endpoints, epochs))
        self.expect("ready", self.sc.p)
        req = self.expect("req", self.sc.d)[0][2]
        for q in self.pctl:
            q.put(req)

    def results(self, roles=("prefill", "decode")) -> dict[tuple[str, int], Result]:
        n = (self.sc.p if "prefill" in roles else 0) + (self.sc.d if "decode" in roles else 0)
        return {(m[2].role, m[2].rank): m[2] for m in self.expect("result", n)}


def _assert_done(results, sc: Scenario):
    for key, r in results.items():
        assert r.status == "DONE", (key, r)
        assert r.all_free, key
        if r.role == "decode":
            assert r.data_ok, key
    assert sum(r.num_bytes for r in results.values() if r.role == "prefill") == \
        sum(r.num_bytes for r in results.values() if r.role == "decode") > 0


# Every TP split over NIXL; over IPC the uneven ones (p=d is their common case).
