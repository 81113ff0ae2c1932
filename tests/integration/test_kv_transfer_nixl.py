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
import signal
import time

import pytest
import torch

nixl = pytest.importorskip("nixl._api", reason="NIXL is not installed")

from kv_transfer.interface import FailureReason, TransferConfig, TransferStatus  # noqa: E402
from kv_transfer.messages import TransferRequest, decode, encode  # noqa: E402
from model.kv_cache import KVManager, KVPool  # noqa: E402
from tests.support.nixl_cluster import WAIT, Cluster, Scenario, _assert_done, _get  # noqa: E402
from tests.unit.test_kv_transfer_loopback import (greedy_decode, prefill, scattered_pages, tiny_model,  # noqa: E402
                                                  tiny_spec)


@pytest.fixture(autouse=True)
def _ucx_over_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


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
