"""Workers under overload and faults, as real processes (router + 1 prefill + 1 decode on the tiny
model, KV over NIXL/UCX TCP loopback):

  - 32 streaming clients leave mid-generation (the router aborts on stream close) while 32
    disaggregated requests are abandoned at every stage by direct Abort frames (queued at the
    prefill worker, prefilling, transferring, decoding): within 2 s of the last one the decode
    worker runs nothing and every page of both workers is free;
  - a few thousand hostile frames on both workers' sockets (random bytes, truncated msgpack, wrong
    shapes, huge declared lengths, deep nesting, wrong versions and tags, typed nonsense): both
    still answer status, serve a normal request, and leak no page;
  - a decode worker killed with SIGKILL: its stream fails at once with a clear error; restarted on
    the same address (and KV side-channel port) it is serving again within the router's poll
    interval, and a KV promise of its previous epoch is refused by epoch, nothing hangs;
  - drain deadlines: a prefill worker stuck on a silent decode worker ends its running and queued
    requests at --drain-timeout-s and exits in time; a TP-2 decode worker with 16 streams in flight
    finishes the short ones, ends the rest with finish_reason "abort" at the deadline, and its
    follower rank stops cleanly.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import pytest
import zmq

from kv_transfer.messages import TransferRequest
from kv_transfer.messages import decode as decode_kv
from tests.support.fuzz import frames
from tests.support.ports import free_port
from tests.support.service import Service, start_service
from wire.protocol import (Abort, AdmitRequest, Admitted, GenerateRequest, PrefillRequest, PrefillResult,
                           SamplingSpec, StartDecode, StatusRequest, TokenBatch, TokenChunk, WorkerStatus, decode,
                           encode)

pytest.importorskip("nixl._api", reason="NIXL is not installed")

DRAIN_S = 3.0
LONG = SamplingSpec(max_tokens=3000, temperature=0.0, ignore_eos=True)


def _port() -> int:
    return free_port()  # not an ephemeral port: tests/support/ports.py


class Peer:
    """The router's side of the wire protocol, for one worker (a TokenBatch is read as its chunks)."""

    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.ready: collections.deque = collections.deque()

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float = 60.0) -> object:
        if not self.ready:
            if not self.sock.poll(int(timeout_s * 1000)):
                raise TimeoutError("no reply")
            m = decode(self.sock.recv())
            self.ready.extend(m.chunks if isinstance(m, TokenBatch) else [m])
        return self.ready.popleft()

    def ask(self, msg: object, timeout_s: float = 60.0) -> object:
        self.send(msg)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.sock.close(0)


def status(addr: str, timeout_s: float = 10.0) -> WorkerStatus:
    p = Peer(addr)
    try:
        st = p.ask(StatusRequest(), timeout_s)
        assert isinstance(st, WorkerStatus)
        return st
    finally:
        p.close()


def wait_idle(svc: Service, timeout_s: float) -> float:
    """Seconds until the decode worker runs and holds nothing (asserts it happens within timeout_s)."""
    t0 = time.monotonic()
    while True:
        st = status(svc.decode[0])
        if st.running == 0 and st.queue_depth == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, f"decode worker still busy: {st}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def svc(ckpt_factory):
    s = start_service(ckpt_factory("tiny"), max_num_seqs=64, extra_prefill=["--drain-timeout-s", str(DRAIN_S)],
                      extra_decode=["--kv-port", str(_port())])
    yield s
    for p in s.procs:  # a test may have stopped one (SIGSTOP)
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    s.stop()


def chat_body(max_tokens: int, stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


# ---- cancellation -------------------------------------------------------------------------------------
def _stream_and_leave(url: str) -> float:
    """Read a few SSE events, then close the connection mid-generation. Returns when it left."""
    n = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(3000, True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            n += line.startswith("data: {")
            if n >= 4:
                break
    assert n >= 4
    return time.monotonic()


def _abandon(svc: Service, i: int) -> float:
    """A disaggregated request the router gives up on at stage i % 4 (direct Abort frames).
    Returns when its last Abort went out."""
    rid, prompt = f"abandon-{i}", [200006, 17360, 200008] + [1000 + 13 * i + j for j in range(5 + 7 * (i % 5))]
    d, p = Peer(svc.decode[0]), Peer(svc.prefill[0])
    try:
        adm = d.ask(AdmitRequest(rid, len(prompt), LONG.max_tokens, 1, 60.0))
        assert isinstance(adm, Admitted), adm
        p.send(PrefillRequest(rid, prompt, LONG, adm.kv_target, 60.0))
        stage = i % 4
        if stage < 2:  # while queued, or prefilling / transferring: no reply is promised
            if stage == 1:
                time.sleep(0.05)
            p.send(Abort(rid, "client went away"))
            d.send(Abort(rid, "client went away"))
            return time.monotonic()
        res = p.recv(60)
        assert isinstance(res, PrefillResult) and res.ok, res
        if stage == 2:  # KV landed, StartDecode never sent
            d.send(Abort(rid, "client went away"))
            return time.monotonic()
        d.send(StartDecode(rid, prompt, LONG, res.first_token, res.first_logprob, res.first_top))
        chunk = d.recv(60)
        assert isinstance(chunk, TokenChunk) and chunk.token_ids and not chunk.finished, chunk
        d.send(Abort(rid, "client went away"))
        return time.monotonic()
    finally:
        time.sleep(0.05)  # let the last frame leave before the socket closes
        d.close()
        p.close()


def test_disconnects_and_aborts_free_everything_within_2s(svc):
    with cf.ThreadPoolExecutor(64) as ex:
        streams = [ex.submit(_stream_and_leave, svc.url) for _ in range(32)]
        abandoned = [ex.submit(_abandon, svc, i) for i in range(32)]
        last_left = max(f.result() for f in streams + abandoned)
    wait_idle(svc, timeout_s=2.0)
    took = time.monotonic() - last_left
    assert took < 2.0, f"the decode worker was still busy {took:.2f} s after the last client left"
    svc.assert_no_leaks(timeout_s=2.0)
    print(f"decode worker idle (running 0, nothing queued) {took:.2f} s after the last client left")
    assert "dropped queued request" in svc.log(0) or "aborted by the router" in svc.log(0)
    r = httpx.post(svc.url + "/v1/chat/completions", json=chat_body(8, False), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


# ---- hostile frames -----------------------------------------------------------------------------------
def test_socket_fuzz_leaves_every_worker_alive_and_leak_free(svc):
    rng = random.Random(1234)
    ids: list[str] = []
    ctx = zmq.Context.instance()
    t0 = time.monotonic()
    for addr in (svc.prefill[0], svc.decode[0]):
        socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(addr)
        for i, f in enumerate(frames(rng, 1500, ids)):
            socks[i % len(socks)].send_multipart(f)
        big = ctx.socket(zmq.DEALER)  # over the frame bound: ZMQ drops this connection, nothing else
        big.setsockopt(zmq.LINGER, 0)
        big.connect(addr)
        big.send(b"\x00" * ((64 << 20) + 1))
        time.sleep(0.5)
        for s in socks:  # every request the fuzz may have started is ended, as a router would
            for rid in set(ids):
                s.send(encode(Abort(rid, "fuzz over")))
        time.sleep(0.2)
        for s in (*socks, big):
            s.close(0)
    print(f"{2 * 1500} frames in {time.monotonic() - t0:.1f} s")
    for i, p in enumerate(svc.procs):
        assert p.poll() is None, svc.log(i)[-3000:]
    for addr in (svc.prefill[0], svc.decode[0]):
        assert status(addr).ready
    for i in (0, 1):
        assert "dropped a malformed frame" in svc.log(i)
    r = httpx.post(svc.url + "/v1/chat/completions", json=chat_body(8, False), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    svc.assert_no_leaks(timeout_s=10.0)


# ---- restart and rejoin ----------------------------------------------------------------------------------
def test_killed_decode_fails_fast_rejoins_and_refuses_stale_promises(svc):
    decode_i = len(svc.prefill)
    # a KV promise of the decode worker's current epoch, never used before it dies
    d = Peer(svc.decode[0])
    stale_prompt = [200006, 17360, 200008, 3, 99, 1234, 200007]
    stale = d.ask(AdmitRequest("stale", len(stale_prompt), 4, 1, 60.0))
    d.close()
    assert isinstance(stale, Admitted)
    # a stream in flight when the worker dies ends with an error event at once, not at a timeout
    events: list[str] = []
    with httpx.stream("POST", svc.url + "/v1/chat/completions", json=chat_body(3000, True), timeout=60) as r:
        lines = r.iter_lines()
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        svc.procs[decode_i].send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
        t_end = time.monotonic() - t_kill
    errors = [json.loads(e[6:])["error"]["message"] for e in events if e.startswith('data: {"error"')]
    assert errors and "decode worker" in errors[0], events[-3:]
    assert t_end < 2.0, f"the stream outlived its worker by {t_end:.1f} s"
    svc.procs[decode_i].wait()
    # restarted on the same address: serving again within the router's poll interval once it is up
    svc.restart(decode_i)
    t_end = time.monotonic() + 120
    while True:
        assert time.monotonic() < t_end and svc.procs[decode_i].poll() is None, svc.log(decode_i)[-3000:]
        try:
            if status(svc.decode[0], timeout_s=0.5).ready:
                break
        except TimeoutError:
            pass
    t_up = time.monotonic()
    while httpx.get(svc.url + "/ready").status_code != 200:
        assert time.monotonic() - t_up < 2.0, "the router did not take the restarted worker back"
        time.sleep(0.05)
    rejoin_s = time.monotonic() - t_up
    r = httpx.post(svc.url + "/v1/chat/completions", json=chat_body(8, False), timeout=60)
    assert r.status_code == 200, r.text
    print(f"router took the restarted decode worker back {rejoin_s:.2f} s after it answered")
    # the dead epoch's promise: the prefill worker is refused by epoch (same side-channel port)
    target = decode_kv(stale.kv_target, TransferRequest)
    assert status(svc.decode[0]).epoch != stale.epoch
    p = Peer(svc.prefill[0])
    t0 = time.monotonic()
    res = p.ask(PrefillRequest("stale", stale_prompt, SamplingSpec(max_tokens=4), stale.kv_target, 60.0), 30)
    p.close()
    assert isinstance(res, PrefillResult) and not res.ok and "epoch" in res.error, res
    assert time.monotonic() - t0 < 10, "refused by epoch, not by the transfer deadline"
    assert target.decode_epochs[0] == stale.epoch
    d = Peer(svc.decode[0])
    late = d.ask(StartDecode("stale", stale_prompt, SamplingSpec(max_tokens=4), res.first_token, None, []), 10)
    d.close()
    assert isinstance(late, TokenChunk) and late.finished and late.finish_reason == "abort"
    svc.assert_no_leaks(timeout_s=10.0)


# ---- drain deadlines -------------------------------------------------------------------------------------
def test_prefill_drain_deadline_ends_a_stuck_transfer_and_exits_in_time(svc):
    """The decode worker is frozen (SIGSTOP): the running prefill waits on its KV transfer, two more
    queue behind it. SIGTERM: at the drain deadline all three end with a clear error, and the
    process exits within deadline + 5 s."""
    d, p = Peer(svc.decode[0]), Peer(svc.prefill[0])
    prompt = [200006, 17360, 200008, 5, 6, 7]
    targets = []
    for i in range(3):
        adm = d.ask(AdmitRequest(f"frozen-{i}", len(prompt), 4, 1, 120.0))
        assert isinstance(adm, Admitted)
        targets.append(adm.kv_target)
    decode_proc, prefill_proc = svc.procs[len(svc.prefill)], svc.procs[0]
    decode_proc.send_signal(signal.SIGSTOP)
    try:
        for i, t in enumerate(targets):
            p.send(PrefillRequest(f"frozen-{i}", prompt, SamplingSpec(max_tokens=4), t, 120.0))
        time.sleep(1.0)
        assert status(svc.prefill[0]).running == 1
        prefill_proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        results = [p.recv(DRAIN_S + 10) for _ in range(3)]
        t_results = time.monotonic() - t_term
        assert all(isinstance(r, PrefillResult) and not r.ok and "worker drain deadline reached" in r.error
                   for r in results), results
        assert DRAIN_S - 0.5 < t_results < DRAIN_S + 2
        prefill_proc.wait(DRAIN_S + 5 - (time.monotonic() - t_term))
        assert prefill_proc.returncode == 0, svc.log(0)[-3000:]
    finally:
        decode_proc.send_signal(signal.SIGCONT)
        p.close()
        d.close()


@pytest.fixture(scope="module")
def tp2_decode(ckpt_factory):
    """A TP-2 decode worker (no KV backend: it prefills its own requests)."""
    port = _port()
    log = tempfile.NamedTemporaryFile(prefix="tandem-drain-", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "decode-worker", "--checkpoint",
                             ckpt_factory("tiny"), "--device", "cpu", "--host", "127.0.0.1", "--kv-backend", "none",
                             "--max-num-seqs", "32", "--kv-cache-gib", "0.0625", "--port", str(port),
                             "--metrics-port", "0", "--tp", "2", "--tp-timeout-s", "30", "--drain-timeout-s", "4"],
                            env=env, stdout=subprocess.DEVNULL, stderr=log)
    addr = f"tcp://127.0.0.1:{port}"
    t_end = time.monotonic() + 240
    while True:
        assert proc.poll() is None and time.monotonic() < t_end, open(log.name).read()[-3000:]
        try:
            if status(addr, timeout_s=1.0).ready:
                break
        except TimeoutError:
            pass
        time.sleep(0.3)
    yield proc, addr, log.name
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_decode_drain_deadline_with_16_streams_and_tp_followers_exit_cleanly(tp2_decode):
    proc, addr, log_path = tp2_decode
    deadline_s = 4.0
    peer = Peer(addr)
    short = SamplingSpec(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"s{i}": [200006, 17360, 200008, 40 + i] for i in range(16)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        peer.send(GenerateRequest(rid, prompt, short if i % 2 else LONG))
    got: dict[str, list[TokenChunk]] = {rid: [] for rid in prompts}
    ended_at: dict[str, float] = {}

    def take(m: TokenChunk, t_term: float) -> None:
        got[m.request_id].append(m)
        if m.finished:
            ended_at[m.request_id] = time.monotonic() - t_term

    while any(not c for c in got.values()):  # every stream has produced tokens: all in flight
        take(peer.recv(60), float("inf"))
    proc.send_signal(signal.SIGTERM)
    t_term = time.monotonic()
    peer.send(GenerateRequest("late", [1, 2, 3], short))
    refused = None
    while len(ended_at) < len(prompts) or refused is None:
        m = peer.recv(deadline_s + 5)
        if m.request_id == "late":
            refused = m
        else:
            take(m, t_term)
    assert refused.finished and refused.finish_reason == "abort" and "draining" in refused.error
    for i, rid in enumerate(prompts):
        last = got[rid][-1]
        if i % 2:  # short: completes while draining
            assert last.finish_reason == "length" and sum(len(c.token_ids) for c in got[rid]) == 12
        else:  # long: ended at the deadline with a clear message
            assert last.finish_reason == "abort" and last.error == "worker drain deadline reached", last
            assert deadline_s - 0.5 < ended_at[rid] < deadline_s + 2, ended_at[rid]
    peer.close()
    proc.wait(deadline_s + 5 - (time.monotonic() - t_term))
    exit_s = time.monotonic() - t_term
    log = open(log_path, errors="replace").read()
    assert proc.returncode == 0, log[-3000:]
    assert exit_s < deadline_s + 5
    assert "drain deadline reached: ended 8 requests" in log
    for rank in (0, 1):
        assert f"tensor-parallel rank {rank} stopped: 0 open receives, 0 open sends, 0 quarantined pages" in log
    print(f"drained with 16 streams: exit {exit_s:.2f} s after SIGTERM (deadline {deadline_s} s)")
