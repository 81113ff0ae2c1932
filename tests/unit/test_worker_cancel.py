"""Cancellation inside the workers' engines, in one process (a tiny random gpt-oss, KV over the
loopback backend): a prefill stops between layers or chunks once cancelled and frees its pages, its
transfer fails closed so the decode worker's reservation comes back; a decode worker's Abort frees
a reservation whose KV already landed, a waiting and a running sequence; the drain deadline ends
everything with finish_reason "abort"; malformed-but-typed requests are refused, never crash."""

from __future__ import annotations

import time

import pytest

from decode_worker.engine import DecodeEngine
from engine.build import EngineConfig, build_engine_parts
from engine.scheduler import SchedulerConfig
from kv_transfer.interface import TransferConfig, TransferStatus
from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from model.kv_cache import PageGroup
from prefill_worker.engine import PrefillEngine
from wire.protocol import (AdmitRequest, Admitted, GenerateRequest, PrefillRequest, Rejected, SamplingSpec,
                           StartDecode)

PEER = b"router"
SPEC = SamplingSpec(max_tokens=50, temperature=0.0, ignore_eos=True)


def parts(chunk: int):
    cfg = EngineConfig(random_preset="tiny-a", kv_cache_bytes=2 << 20,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=1024))
    return build_engine_parts(cfg)


@pytest.fixture
def pair():
    """(prefill engine, decode engine) joined by a private loopback hub."""
    hub = LoopbackHub()
    pp, dp = parts(chunk=16), parts(chunk=512)
    tx = LoopbackSender(pp.pool, TransferConfig("pre", "tiny-a"), hub)
    rx = LoopbackReceiver(dp.pool, TransferConfig("dec", "tiny-a"), hub)
    return PrefillEngine(pp, tx), DecodeEngine(dp, rx)


def all_free(kv) -> bool:
    return kv.num_free() == tuple(kv.spec.num_pages[g] for g in PageGroup)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 500 for i in range(n)]


def admit(dec: DecodeEngine, rid: str, n: int, deadline_s: float = 30.0) -> Admitted:
    a = dec.admit(PEER, AdmitRequest(rid, n, SPEC.max_tokens, 1, deadline_s))
    assert isinstance(a, Admitted), a
    return a


def settle(dec: DecodeEngine, timeout_s: float = 5.0) -> list:
    """Poll transfers and complete a step still in flight (the overlapped loop frees an aborted
    sequence's pages once no launched step can write them) until nothing is left."""
    out, end = [], time.monotonic() + timeout_s
    while (dec.pending or dec.has_work or not all_free(dec.kv)) and time.monotonic() < end:
        out += dec.poll_transfers()
        dec.step()
        time.sleep(0.001)
    return out


class CancelAfter:
    """cancelled() for PrefillEngine.run: '' for the first n calls, then the reason."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> str:
        self.calls += 1
        return "client went away" if self.calls > self.n else ""


def test_prefill_stops_between_layers_and_both_sides_free_their_pages(pair):
    pre, dec = pair
    n = 20  # two chunks of 16: the transfer starts before the second
    a = admit(dec, "r", n)
    # checks: before chunk 1, after each of its layers, before chunk 2, after its layer 0 (-> stop)
    cancel = CancelAfter(1 + pre.parts.model.cfg.num_hidden_layers + 1)
    res = pre.run(PrefillRequest("r", prompt(n), SPEC, a.kv_target, 30.0), cancel)
    assert not res.ok and "client went away" in res.error, res
    # the forward was left right after the check that said stop: no later layer asked again
    assert cancel.calls == cancel.n + 1
    assert all_free(pre.kv)
    assert dec.rx.poll("r") == TransferStatus.FAILED
    chunks = settle(dec)
    assert all_free(dec.kv) and not dec.pending
    assert [c.finish_reason for _, c in chunks] == ["abort"] and "kv transfer failed" in chunks[0][1].error


def test_prefill_cancelled_before_its_transfer_starts(pair):
    pre, dec = pair
    a = admit(dec, "r", 40)
    cancel = CancelAfter(2)  # goes on before chunk 1 and after its layer 0, stops after layer 1
    res = pre.run(PrefillRequest("r", prompt(40), SPEC, a.kv_target, 30.0), cancel)
    assert not res.ok and "cancelled before its transfer started" in res.error
    assert cancel.calls == 3 and all_free(pre.kv)
    dec.abort("r", "router abort")  # what the router sends the decode worker
    settle(dec)
    assert all_free(dec.kv) and not dec.pending


def test_a_tp_group_prefill_stops_between_chunks_only(pair):
    pre, dec = pair
    pre.runner.interruptible = False  # as engine.tp.proxies.GroupRunner: no checks inside a forward
    a = admit(dec, "r", 40)
    cancel = CancelAfter(1)  # after chunk 1 (checked before chunk 2)
    res = pre.run(PrefillRequest("r", prompt(40), SPEC, a.kv_target, 30.0), cancel)
    assert not res.ok and cancel.calls == 2 and all_free(pre.kv)


def test_decode_abort_frees_landed_kv_waiting_and_running_sequences(pair):
    pre, dec = pair
    a = admit(dec, "landed", 12)
    res = pre.run(PrefillRequest("landed", prompt(12), SPEC, a.kv_target, 30.0))
    assert res.ok and dec.rx.poll("landed") == TransferStatus.DONE
    dec.abort("landed", "client went away")  # KV landed, StartDecode never came: freed now
    assert all_free(dec.kv) and not dec.pending
    assert dec.generate(PEER, GenerateRequest("run", prompt(10), SPEC)) is None
    dec.step()  # its prefill step is launched: running (tokens come a step late)
    assert dec.generate(PEER, GenerateRequest("wait", prompt(10), SPEC)) is None
    assert len(dec.scheduler.running) == 1 and len(dec.scheduler.waiting) == 1
    dec.abort("run", "client went away")
    dec.abort("wait", "client went away")
    assert not dec.scheduler.has_work and not dec.peers
    settle(dec)  # the step in flight completes; nothing of the aborted sequences is sent
    assert all_free(dec.kv) and not dec.has_work


def test_landed_kv_without_start_is_freed_at_its_deadline(pair):
    pre, dec = pair
    a = admit(dec, "r", 12)
    assert pre.run(PrefillRequest("r", prompt(12), SPEC, a.kv_target, 30.0)).ok
    assert dec.rx.poll("r") == TransferStatus.DONE
    dec.pending["r"].deadline = time.time() - 1  # the router never sent StartDecode
    chunks = settle(dec)
    assert [(c.request_id, c.finish_reason) for _, c in chunks] == [("r", "abort")]
    assert "no StartDecode" in chunks[0][1].error and all_free(dec.kv)


def test_landed_kv_waits_for_start_a_bounded_time_whatever_the_reservation(pair):
    """A reservation long enough for a slow prefill does not hold landed KV that long: once the
    transfer is done, a router that sends no StartDecode within LANDED_WAIT_S is gone."""
    from decode_worker.engine import LANDED_WAIT_S

    pre, dec = pair
    a = admit(dec, "r", 12, deadline_s=3000.0)
    assert pre.run(PrefillRequest("r", prompt(12), SPEC, a.kv_target, 30.0)).ok
    assert dec.poll_transfers() == []
    assert dec.pending["r"].deadline <= time.time() + LANDED_WAIT_S


def test_abort_all_ends_every_request_with_a_reason(pair):
    pre, dec = pair
    a = admit(dec, "transfer", 12)  # reserved, KV not sent yet
    b = admit(dec, "started", 12)
    res = pre.run(PrefillRequest("started", prompt(12), SPEC, b.kv_target, 30.0))
    assert dec.start(PEER, StartDecode("started", prompt(12), SPEC, res.first_token, None, [])) is None
    dec.poll_transfers()
    assert dec.generate(PEER, GenerateRequest("colocated", prompt(10), SPEC)) is None
    dec.step()
    ended = dec.abort_all("worker drain deadline reached")
    assert sorted(c.request_id for _, c in ended) == ["colocated", "started", "transfer"]
    assert all(c.finished and c.finish_reason == "abort" and c.error == "worker drain deadline reached"
               for _, c in ended)
    settle(dec)
    assert all_free(dec.kv) and not dec.has_work and not dec.peers
    assert a.kv_target  # the abandoned reservation's promise is void: a late prefill is refused
    late = pre.run(PrefillRequest("transfer", prompt(12), SPEC, a.kv_target, 30.0))
    assert not late.ok and all_free(pre.kv) and all_free(dec.kv)


@pytest.mark.parametrize("ids", [[1, 2, 10**9], [1, -5], []], ids=["past-vocab", "negative", "empty"])
def test_typed_but_invalid_prompts_are_refused_not_crashing(pair, ids):
    pre, dec = pair
    chunk = dec.generate(PEER, GenerateRequest("g", ids, SPEC))
    assert chunk is not None and chunk.finish_reason == "abort" and "prompt" in chunk.error
    a = admit(dec, "d", 3)
    res = pre.run(PrefillRequest("d", [1, 2, 10**9], SPEC, a.kv_target, 30.0))
    assert not res.ok and "prompt token ids" in res.error
    bad_start = dec.start(PEER, StartDecode("d", [1, 2, 3], SPEC, 10**9, None, []))
    assert bad_start is not None and bad_start.finish_reason == "abort"
    settle(dec)
    assert all_free(dec.kv) and all_free(pre.kv) and not dec.has_work


def test_admission_refuses_nonsense_and_duplicates(pair):
    _, dec = pair
    for m in (AdmitRequest("x", 0, 1, 1, 1.0), AdmitRequest("x", 3, 0, 1, 1.0), AdmitRequest("x", 3, 1, 1, -1.0),
              AdmitRequest("x", 3, 1, 1, float("inf")), AdmitRequest("x", 3, 1, 1, float("nan"))):
        assert isinstance(dec.admit(PEER, m), Rejected), m
    admit(dec, "y", 3)
    assert isinstance(dec.admit(PEER, AdmitRequest("y", 3, 1, 1, 1.0)), Rejected)
    top_k = dec.generate(PEER, GenerateRequest("k", [1, 2], SamplingSpec(max_tokens=2, top_k=2**63)))
    assert top_k is not None and "top_k" in top_k.error
    dec.abort("y", "done")
    settle(dec)
    assert all_free(dec.kv)


class SlowCompute:
    """cancelled() that takes `pause_s` on its call number `at` (a slow chunk, as a long prompt on a CPU)."""

    def __init__(self, at: int, pause_s: float) -> None:
        self.at, self.pause_s, self.calls = at, pause_s, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.pause_s)
        return ""


def test_prefill_stops_once_decode_reservation_deadline_passed(pair):
    """Decode lets the pages go at its reservation's deadline: a prefill still computing then stops
    (between layers) rather than computing the rest of the prompt for a transfer that must fail."""
    pre, dec = pair
    # 1.5 s of slack before the first check: a loaded CI machine took > 0.3 s to reach it
    a = admit(dec, "r", 40, deadline_s=1.5)
    slow = SlowCompute(at=2, pause_s=1.6)  # after chunk 1's layer 0
    res = pre.run(PrefillRequest("r", prompt(40), SPEC, a.kv_target, 30.0), slow)
    assert not res.ok and "reservation's deadline passed during prefill" in res.error, res
    assert slow.calls == 2 and all_free(pre.kv)  # stopped at the first check past the deadline
    dec.abort("r", "router abort")
    settle(dec)
    assert all_free(dec.kv) and not dec.pending


def test_transfer_deadline_runs_from_the_transfer_start(pair):
    """The router's transfer deadline (PrefillRequest.deadline_s) bounds the transfer from its start
    within decode's reservation: compute longer than it does not fail the request."""
    pre, dec = pair
    a = admit(dec, "r", 20, deadline_s=30.0)
    started = []
    start = pre.tx.start
    pre.tx.start = lambda req, pages: (started.append((time.time(), req.deadline_unix)), start(req, pages))[1]
    res = pre.run(PrefillRequest("r", prompt(20), SPEC, a.kv_target, 0.5), SlowCompute(at=1, pause_s=0.8))
    assert res.ok, res  # 0.8 s of "compute" before the transfer, past the 0.5 s transfer deadline
    (t, deadline), = started
    assert 0.4 < deadline - t <= 0.5  # the transfer's own deadline, not the reservation's 30 s
    assert dec.rx.poll("r") == TransferStatus.DONE
