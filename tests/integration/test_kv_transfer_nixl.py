"""NIXL KV transfer between REAL processes over UCX/TCP on loopback (host memory): one process per
prefill rank and per decode rank, started with `spawn`.

Shown: random pools land byte-exact in scattered decode pages for p = d, p < d and p > d, the
sliding group ships only its tail, layers land one by one; and each fault ends in a defined
status on the surviving side within the deadline with every page back in its KVManager's free
pool: sender killed, receiver killed, deadline, epoch mismatch (decode restarted), handshake
mismatch, decode abort. Finally a tiny gpt-oss decodes identical tokens after a NIXL prefill.

The same-node data path (TransferBackend.IPC: NIXL control plane, bytes copied into the decode
pool mapped from shared memory) runs the byte-exact and two fault scenarios too, and falls back to
NIXL WRITEs for a decode rank that claims another node. `Scenario.devices` puts the pools on GPUs
(tests/integration/test_kv_transfer_ipc_gpu.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from dataclasses import dataclass, field

import pytest
import torch

nixl = pytest.importorskip("nixl._api", reason="NIXL is not installed")

from kv_transfer.interface import FailureReason, TransferConfig, TransferStatus  # noqa: E402
from kv_transfer.messages import TransferRequest, decode, encode  # noqa: E402
from model.kv_cache import KVManager, KVPool, PageGroup  # noqa: E402
from tests.unit.test_kv_transfer_loopback import (LAYERS, dst_block, expected_block, greedy_decode,  # noqa: E402
                                                  prefill, random_pool, scattered_pages, spec_for, tiny_model,
                                                  tiny_spec)

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
    spec = spec_for(sc.d)
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
    src = [random_pool(spec_for(sc.p), 100 + r) for r in range(sc.p)]
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
        res.data_ok = res.data_ok and all(pool.pools[PageGroup.SLIDING][:, :, pg].abs().sum() == 0 for pg in untouched)
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
    spec = spec_for(sc.p, page=sc.prefill_page_size)
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


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


def _assert_done(results, sc: Scenario):
    for key, r in results.items():
        assert r.status == "DONE", (key, r)
        assert r.all_free, key
        if r.role == "decode":
            assert r.data_ok, key
    assert sum(r.num_bytes for r in results.values() if r.role == "prefill") == \
        sum(r.num_bytes for r in results.values() if r.role == "decode") > 0


# Every TP split over NIXL; over IPC the uneven ones (p=d is their common case).
@pytest.mark.parametrize("p,d,data_path", [(1, 1, "nixl"), (1, 2, "nixl"), (2, 1, "nixl"), (1, 2, "ipc"), (2, 1, "ipc")],
                         ids=["p=d-nixl", "p<d-nixl", "p>d-nixl", "p<d-ipc", "p>d-ipc"])
def test_pages_land_byte_exact(p, d, data_path):
    sc = Scenario(p=p, d=d, n_tokens=100, pause_after=1, check_partial=True, data_path=data_path)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused", p)
        for q in c.dctl:
            q.put("check")
        c.expect("checked", d)
        for q in c.pctl:
            q.put("go")
        results = c.results()
    _assert_done(results, sc)
    for s in range(d):
        assert results[("decode", s)].partial_ok, "layers must land one by one"
    for r in range(p):  # every prefill rank wrote every decode rank it shares heads with, by that path
        paths = results[("prefill", r)].paths
        assert paths and set(paths.values()) == {data_path}, paths


def test_ipc_falls_back_to_nixl_for_another_node():
    sc = Scenario(pause_after=1, check_partial=True, data_path="ipc", decode_node="elsewhere")
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        c.dctl[0].put("check")
        c.expect("checked")
        c.pctl[0].put("go")
        results = c.results()
    _assert_done(results, sc)
    assert list(results[("prefill", 0)].paths.values()) == ["nixl"], results[("prefill", 0)]


def test_sender_killed_mid_transfer():
    sc = Scenario(pause_after=1, deadline_s=20.0, check_partial=True)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        c.dctl[0].put("check")
        c.expect("checked")  # two layers have landed: the sender is mid-transfer
        os.kill(c.pre[0].pid, signal.SIGKILL)
        (_, _, r), = c.expect("result")
    # The layers written before the kill landed byte-exact (partial_ok). Whether their LayerDone
    # notifications were processed before the kill (num_bytes) is a race without a progress thread.
    assert r.partial_ok, r
    assert r.status == "FAILED" and r.reason == FailureReason.PEER_DEAD.name, r
    assert r.seconds_to_terminal < sc.deadline_s / 2 and r.seconds_to_pages_free < sc.deadline_s / 2, r
    assert r.all_free


@pytest.mark.parametrize("data_path", ["nixl", "ipc"])
def test_receiver_killed_mid_transfer(data_path):
    sc = Scenario(pause_after=1, deadline_s=20.0, check_partial=True, data_path=data_path)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        c.dctl[0].put("check")
        c.expect("checked")
        os.kill(c.dec[0].pid, signal.SIGKILL)
        time.sleep(0.2)
        c.pctl[0].put("go")
        (_, _, r), = c.expect("result")
    assert r.role == "prefill" and r.status == "FAILED" and r.reason == FailureReason.PEER_DEAD.name, r
    assert r.seconds_to_terminal < sc.deadline_s / 2 and r.all_free, r


def test_deadline_exceeded_frees_both_sides():
    sc = Scenario(pause_after=1, deadline_s=2.0)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        (_, _, dr), = c.expect("result", timeout=10)  # decode gives up at its deadline ...
        c.pctl[0].put("go")  # ... the stalled prefill resumes too late
        (_, _, pr), = c.expect("result")
    assert dr.status == pr.status == "FAILED" and dr.reason == pr.reason == FailureReason.DEADLINE.name, (dr, pr)
    assert 1.5 < dr.seconds_to_terminal < 4.0, dr
    assert dr.all_free and pr.all_free


@pytest.mark.parametrize("data_path", ["nixl", "ipc"])
def test_epoch_mismatch_after_decode_restart(data_path):
    sc = Scenario(restart_decode=True, data_path=data_path)
    with Cluster(sc) as c:
        c.wire()
        results = c.results()
    pr, dr = results[("prefill", 0)], results[("decode", 0)]
    assert pr.status == "FAILED" and pr.reason == FailureReason.EPOCH_MISMATCH.name, pr
    # The restarted decode never got a byte; its own request times out and its pages come back.
    assert dr.status == "FAILED" and dr.reason == FailureReason.DEADLINE.name and dr.num_bytes == 0, dr
    assert dr.data_ok and dr.all_free and pr.all_free


def test_handshake_mismatch_refused_by_both():
    sc = Scenario(prefill_page_size=16)
    with Cluster(sc) as c:
        c.wire()
        results = c.results()
    pr, dr = results[("prefill", 0)], results[("decode", 0)]
    assert pr.status == dr.status == "FAILED", results
    assert pr.reason == dr.reason == FailureReason.HANDSHAKE_MISMATCH.name, results
    assert "page_size: 16 here vs 8 at the peer" in pr.detail, pr.detail
    assert dr.seconds_to_terminal < sc.deadline_s / 2 and pr.all_free and dr.all_free


def test_decode_abort_stops_prefill():
    sc = Scenario(pause_after=1, abort_after_first_layer=True)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        (_, _, dr), = c.expect("result")
        c.pctl[0].put("go")
        (_, _, pr), = c.expect("result")
    assert dr.status == pr.status == "FAILED" and dr.reason == pr.reason == FailureReason.ABORTED.name, (dr, pr)
    assert dr.all_free and pr.all_free


# ---- a real tiny model on both sides ----------------------------------------------------------------
def tiny_decode_main(ctl, out) -> None:
    from kv_transfer.nixl_receiver import NixlReceiver
    from model.kv_cache import SeqPages
    model = tiny_model()
    spec = tiny_spec(model)
    prompt = torch.randint(0, model.cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(9)).tolist()
    pool, kv = KVPool(spec), KVManager(spec)
    pages = scattered_pages(kv, len(prompt), seed=5)
    rx = NixlReceiver(pool, TransferConfig("dec", "tiny-a"))
    out.put(("req", encode(rx.expect("q", pages, len(prompt), time.time() + 20)), prompt))
    t0 = time.monotonic()
    while not rx.poll("q").terminal and time.monotonic() - t0 < WAIT:  # the decode loop keeps polling
        time.sleep(0.002)
    status = rx.finish("q").status if rx.poll("q") == TransferStatus.DONE else rx.outcome("q").status
    first = ctl.get(timeout=WAIT)  # prefill's first token travels with the result, via the router
    got = greedy_decode(model, pool, kv, pages, first, len(prompt), 10)
    ref_pool, ref_kv, ref_pages = KVPool(spec), KVManager(spec), SeqPages()
    ref_kv.grow(ref_pages, len(prompt))
    want = greedy_decode(model, ref_pool, ref_kv, ref_pages, prefill(model, ref_pool, ref_pages, prompt),
                         len(prompt), 10)
    out.put(("tokens", status.name, got, want))
    rx.close()


def tiny_prefill_main(ctl, out) -> None:
    from kv_transfer.nixl_sender import NixlSender
    from model.kv_cache import SeqPages
    model = tiny_model()
    spec = tiny_spec(model)
    pool, kv, pages = KVPool(spec), KVManager(spec), SeqPages()
    tx = NixlSender(pool, TransferConfig("pre", "tiny-a"))
    req_bytes, prompt = ctl.get(timeout=WAIT)
    req = decode(req_bytes, TransferRequest)
    kv.grow(pages, len(prompt))
    tx.start(req, pages)
    first = prefill(model, pool, pages, prompt, on_layer_done=tx.layer_done)
    while not tx.poll("q").terminal:
        time.sleep(0.002)
    out.put(("first", first, tx.finish("q").status.name))
    kv.release(pages)
    time.sleep(0.5)
    tx.close()


def test_tiny_model_decodes_identically_after_nixl_prefill():
    ctx = mp.get_context("spawn")
    out, dctl, pctl = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=tiny_decode_main, args=(dctl, out), daemon=True),
             ctx.Process(target=tiny_prefill_main, args=(pctl, out), daemon=True)]
    for proc in procs:
        proc.start()
    try:
        _, req, prompt = _get(out, "req", 60)
        pctl.put((req, prompt))
        _, first, pstatus = _get(out, "first", 60)
        dctl.put(first)
        _, dstatus, got, want = _get(out, "tokens", 60)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    assert pstatus == dstatus == "DONE"
    assert got == want
