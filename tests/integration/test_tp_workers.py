"""Multi-rank workers (`--tp 2`) as real processes on the CPU (gloo between ranks, KV over NIXL/UCX
TCP loopback), on the embedded-style tiny model (2 KV heads: TP 2 gives each rank one head).

Shown, greedy outputs always equal to the single-process engine:
  - the router with a TP-2 prefill worker and a TP-2 decode worker serves the unmodified openai
    client (chat, stream, completions with logprobs, concurrent streams);
  - the prefill/decode TP mixes (1,2), (2,1), (2,2) over the router's wire protocol (the test plays the
    router: Admit -> Prefill -> StartDecode), short and longer-than-the-window prompts (prefilled in
    two chunks by the TP-2 workers), plus a colocated request that prefills on the TP-2 decode worker;
    the TP-2 decode worker's lm_head is vocab-parallel (an all-gather of the logits every rank joins);
  - prompt logprobs from both TP-2 workers (vocab-parallel and replicated lm_head);
  - control-plane messages larger than the buffer (tests/unit/test_tp_control.py has the rest of
    the control plane in one process: STEP page deltas, combining the ranks' transfer answers);
  - afterwards every page is back (rank 0 owns allocation for all ranks) and, on a graceful stop,
    every rank reports no open transfer and no quarantined page;
  - a follower killed mid-generation, or while its worker is idle, ends the worker with a clear
    error within seconds (no hang).
"""

from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import pytest
import torch
import zmq
from openai import OpenAI

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.tp import messages as tm
from engine.tp.group import RankGroup
from router.chat_types import ChatMessage, ChatPrompt
from router.harmony import HarmonyFormat
from wire.protocol import (Abort, AdmitRequest, Admitted, GenerateRequest, PrefillRequest, PrefillResult,
                             SamplingSpec, StartDecode, StatusRequest, TokenBatch, TokenChunk, WorkerStatus, decode, encode)
from router.tokenizer import CALL, RETURN

from tests.support.ports import free_port

pytest.importorskip("nixl._api", reason="NIXL is not installed")

STARTUP_S = 240  # the whole cluster, on a loaded 2-core machine
EXIT_S = 20  # a worker whose follower died must be gone within this


def _port() -> int:
    return free_port()  # not an ephemeral port: tests/support/ports.py


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    addr: str = ""

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _spawn(name: str, argv: list[str]) -> Proc:
    # TANDEM_IO_STALL_DUMP_S: when a worker's network thread cannot run for 2 s (what the router sees as
    # a silent worker: it marks one down after ~3 s), every thread's stack goes to the worker log, again
    # every 2 s while it lasts (a rare CI failure had a TP2 decode worker silent for ~9 s)
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1", TANDEM_IO_STALL_DUMP_S="2")
    log = tempfile.NamedTemporaryFile(prefix=f"tandem-tp-{name}-", suffix=".log", delete=False)
    return Proc(name, subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], env=env,
                                       stdout=subprocess.DEVNULL, stderr=log), log.name)


def _worker(name: str, role: str, tp: int, ckpt: str, kv_backend: str = "nixl", extra: tuple[str, ...] = ()) -> Proc:
    port = _port()
    p = _spawn(name, [f"{role}-worker", "--checkpoint", ckpt, "--device", "cpu", "--host", "127.0.0.1",
                      "--kv-backend", kv_backend, "--max-num-seqs", "32", "--kv-cache-gib", "0.0625",
                      "--port", str(port), "--metrics-port", "0", "--tp", str(tp), "--tp-timeout-s", "30", *extra])
    p.addr = f"tcp://127.0.0.1:{port}"
    return p


class Peer:
    """The router's side of the wire protocol, for one worker."""

    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.queued: list[TokenChunk] = []

    def ask(self, msg: object, timeout_s: float = 60.0) -> object:
        self.sock.send(encode(msg))
        return self.recv(timeout_s)

    def recv(self, timeout_s: float = 60.0) -> object:
        """The next message; a decode step's TokenBatch is handed out one TokenChunk at a time."""
        if self.queued:
            return self.queued.pop(0)
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        msg = decode(self.sock.recv())
        if isinstance(msg, TokenBatch):
            self.queued = list(msg.chunks[1:])
            return msg.chunks[0]
        return msg

    def status(self) -> WorkerStatus:
        while self.sock.poll(0):  # late answers
            self.sock.recv()
        # Generous: on the 2-core CI machine ~7 processes share the cores (each NIXL agent's
        # progress thread spins), and a reply once took > 5 s; what is tested is the state, not latency.
        st = self.ask(StatusRequest(), 30.0)
        assert isinstance(st, WorkerStatus)
        return st

    def tokens(self, rid: str, timeout_s: float = 120.0) -> list[int]:
        out: list[int] = []
        while True:
            m = self.recv(timeout_s)
            if isinstance(m, TokenChunk) and m.request_id == rid:
                assert not m.error, m.error
                out += m.token_ids
                if m.finished:
                    return out

    def close(self) -> None:
        self.sock.close(0)


def _wait_ready(procs: list[Proc], router_url: str | None, timeout_s: float) -> None:
    t_end = time.monotonic() + timeout_s
    pending = [p for p in procs if p.addr]
    while pending or router_url:
        assert time.monotonic() < t_end, f"not ready: {[p.name for p in pending]} router={router_url}"
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited during start-up:\n{p.log()[-3000:]}")
        for p in list(pending):
            peer = Peer(p.addr)
            try:
                if peer.status().ready:
                    pending.remove(p)
            except TimeoutError:
                pass
            finally:
                peer.close()
        if not pending and router_url:
            try:
                with urllib.request.urlopen(router_url + "/ready", timeout=2) as r:
                    router_url = None if r.status == 200 else router_url
            except OSError:
                pass
        time.sleep(0.5)


def _stop(procs: list[Proc], grace_s: float = 30.0) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


# ---- the cluster: prefill TP 1 and 2, decode TP 1 and 2, a router over the TP-2 pair ---------------
@dataclass
class Cluster:
    workers: dict[str, Proc]
    router: Proc
    url: str


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def cluster(tiny):
    chunked = ("--max-num-batched-tokens", "256")  # LONG prompts prefill in two chunks on the TP-2 workers
    workers = {"P1": _worker("P1", "prefill", 1, tiny), "P2": _worker("P2", "prefill", 2, tiny, extra=chunked),
               "D1": _worker("D1", "decode", 1, tiny),
               "D2": _worker("D2", "decode", 2, tiny, extra=chunked + ("--vocab-parallel",))}
    port = _port()
    router = _spawn("router", ["router", "--host", "127.0.0.1", "--port", str(port), "--model-name", "m",
                               "--prefill", workers["P2"].addr, "--decode", workers["D2"].addr,
                               "--poll-interval-s", "0.25"])
    c = Cluster(workers, router, f"http://127.0.0.1:{port}")
    procs = [router, *workers.values()]
    try:
        _wait_ready(procs, c.url, STARTUP_S)
        yield c
    finally:
        _stop(procs)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(EngineConfig(checkpoint=tiny, kv_cache_bytes=64 << 20))

    def run(prompt_ids: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=not stop, stop_token_ids=stop)
        return llm.generate([prompt_ids], sp)[0].output_ids

    return run


SPEC = SamplingSpec(max_tokens=10, temperature=0.0, ignore_eos=True)
SHORT = [200006, 17360, 200008, 3, 99, 1234, 200007]
LONG = [(i * 7919 + 11) % 200000 for i in range(300)]  # > window (128): ring pages wrap


def _disagg(prefill: Peer, decode_: Peer, rid: str, prompt: list[int]) -> list[int]:
    adm = decode_.ask(AdmitRequest(rid, len(prompt), SPEC.max_tokens, 1, 60.0))
    assert isinstance(adm, Admitted), adm
    res = prefill.ask(PrefillRequest(rid, prompt, SPEC, adm.kv_target, 60.0), 120.0)
    assert isinstance(res, PrefillResult) and res.ok, res
    assert res.transfer_bytes > 0
    decode_.sock.send(encode(StartDecode(rid, prompt, SPEC, res.first_token, res.first_logprob, res.first_top)))
    return [res.first_token] + decode_.tokens(rid)


def test_router_serves_openai_client_with_tp2_workers(cluster, reference):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [200006, 17360, 200008, 3, 99, 1234, 200007]
    r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == reference(prompt, 12)
    assert len(r.choices[0].logprobs.token_logprobs) == 12
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    full = client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0,
                                          extra_body={"return_token_ids": True})
    chat_prompt = HarmonyFormat().render(ChatPrompt([ChatMessage("user", "What is 2+2?")],
                                                    current_date=time.strftime("%Y-%m-%d")))
    assert full.choices[0].model_extra["token_ids"] == reference(chat_prompt, 16, stop=(RETURN, CALL))
    chunks = list(client.chat.completions.create(model="m", messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (full.choices[0].message.content
                                                                                     or "")
    prompts = [[200006, 17360, 200008] + [1000 + 37 * i + j for j in range(3 + 40 * i)] for i in range(4)]

    def one(p):
        s = client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0, stream=True,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
        return [t for c in s for t in (c.choices[0].model_extra.get("token_ids") or [])]

    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(one, prompts))
    assert got == [reference(p, 8) for p in prompts]


@pytest.mark.parametrize("pair", ["P1-D2", "P2-D1", "P2-D2"])
def test_prefill_decode_tp_mixes_equal_single_process(cluster, reference, pair):
    p_name, d_name = pair.split("-")
    prefill, decode_ = Peer(cluster.workers[p_name].addr), Peer(cluster.workers[d_name].addr)
    try:
        for i, prompt in enumerate((SHORT, LONG)):
            assert _disagg(prefill, decode_, f"{pair}-{i}", prompt) == reference(prompt, SPEC.max_tokens), pair
    finally:
        prefill.close()
        decode_.close()


def test_colocated_request_on_tp2_decode_worker(cluster, reference):
    d = Peer(cluster.workers["D2"].addr)
    try:
        d.sock.send(encode(GenerateRequest("colo", LONG, SPEC)))
        assert d.tokens("colo") == reference(LONG, SPEC.max_tokens)
    finally:
        d.close()


def test_prefix_cache_turns_on_tp_workers(cluster, reference):
    """A conversation's second turn on TP-2 workers: decode holds the first turn (only the rest is
    shipped), the prefill worker computes from its cached prompt, a third turn prefills on the
    decode worker itself; every rank applies the hit's sliding copies; tokens equal one process."""
    p, d = Peer(cluster.workers["P2"].addr), Peer(cluster.workers["D2"].addr)
    try:
        turns, prompt = [], [(i * 104729 + 7) % 200000 for i in range(250)]
        for k in range(2):
            adm = d.ask(AdmitRequest(f"pfx-{k}", len(prompt), SPEC.max_tokens, 1, 60.0, prompt))
            assert isinstance(adm, Admitted), adm
            res = p.ask(PrefillRequest(f"pfx-{k}", prompt, SPEC, adm.kv_target, 60.0), 120.0)
            assert isinstance(res, PrefillResult) and res.ok, res
            d.sock.send(encode(StartDecode(f"pfx-{k}", prompt, SPEC, res.first_token, res.first_logprob,
                                           res.first_top)))
            out = [res.first_token] + d.tokens(f"pfx-{k}")
            assert out == reference(prompt, SPEC.max_tokens), k
            turns.append((adm.cached_tokens, res.cached_tokens))
            prompt = prompt + out + [(i * 31 + 5) % 200000 for i in range(40)]
        assert turns[0] == (0, 0) and turns[1] == (256, 240), turns  # decode computed 259 tokens, prefill 250
        d.sock.send(encode(GenerateRequest("pfx-local", prompt, SPEC)))
        assert d.tokens("pfx-local") == reference(prompt, SPEC.max_tokens)
    finally:
        p.close()
        d.close()


def test_failed_transfers_fail_on_every_rank(cluster):
    """A reservation whose KV never comes (its deadline passes) and one the client abandons before
    prefill: both fail on both decode ranks, the TP-2 prefill is refused by both, and the pages
    come back (checked by the next test, with every rank's state at shutdown)."""
    p, d = Peer(cluster.workers["P2"].addr), Peer(cluster.workers["D2"].addr)
    try:
        assert isinstance(d.ask(AdmitRequest("late", len(SHORT), 4, 1, 1.0)), Admitted)
        gone = d.ask(AdmitRequest("gone", len(LONG), 4, 1, 30.0))
        assert isinstance(gone, Admitted)
        d.sock.send(encode(Abort("gone", "client went away")))
        res = p.ask(PrefillRequest("gone", LONG, SPEC, gone.kv_target, 30.0), 60.0)
        assert isinstance(res, PrefillResult) and not res.ok and "kv transfer" in res.error, res
        chunk = d.recv(30.0)
        assert isinstance(chunk, TokenChunk) and chunk.request_id == "late" and chunk.finished
        assert "kv transfer failed" in chunk.error
    finally:
        p.close()
        d.close()


def test_prompt_logprobs_on_tp2_workers(cluster, tiny):
    """A colocated request on the TP-2 decode worker (vocab-parallel lm_head: its followers join every slice's
    all-gather) and a prefill on the TP-2 prefill worker (replicated lm_head): the single-process engine's values."""
    spec = dataclasses.replace(SPEC, prompt_logprobs=2)
    ref = LLM(EngineConfig(checkpoint=tiny, kv_cache_bytes=64 << 20)).generate(
        [LONG], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=2))[0]
    want = torch.tensor([e.logprob for e in ref.prompt_logprobs])
    d2, p2, d1 = (Peer(cluster.workers[n].addr) for n in ("D2", "P2", "D1"))
    try:
        d2.sock.send(encode(GenerateRequest("colo-lp", LONG, spec)))
        first = d2.recv(120.0)
        assert isinstance(first, TokenChunk) and not first.error and first.prompt is not None, first
        d2.tokens("colo-lp")
        adm = d1.ask(AdmitRequest("p2-lp", len(LONG), spec.max_tokens, 1, 60.0))
        res = p2.ask(PrefillRequest("p2-lp", LONG, spec, adm.kv_target, 60.0), 120.0)
        assert isinstance(res, PrefillResult) and res.ok and res.prompt is not None, res
        d1.sock.send(encode(StartDecode("p2-lp", LONG, spec, res.first_token, res.first_logprob, res.first_top)))
        d1.tokens("p2-lp")
        for got in (first.prompt, res.prompt):
            torch.testing.assert_close(torch.tensor(got.logprobs), want, atol=1e-4, rtol=0)
            assert [[t.token_id for t in top] for top in got.top] == [[t for t, _ in e.top] for e in ref.prompt_logprobs]
    finally:
        for p in (d2, p2, d1):
            p.close()


def test_no_page_leaks_on_any_rank_and_clean_shutdown(cluster):
    for name, w in cluster.workers.items():
        peer = Peer(w.addr)
        try:
            t_end = time.monotonic() + 10
            while True:
                st = peer.status()
                clean = (st.kv_free_pages == st.kv_total_pages and st.kv_free_sliding_pages == st.kv_total_sliding_pages
                         and not st.running and not st.queue_depth)
                if clean:
                    break
                assert time.monotonic() < t_end, f"{name} did not return its pages: {st}"
                time.sleep(0.2)
        finally:
            peer.close()
    _stop([cluster.router, *cluster.workers.values()])  # SIGTERM: each drains, rank 0 stops its followers
    for w in (cluster.workers["P2"], cluster.workers["D2"]):
        log = w.log()
        assert w.popen.returncode == 0, log[-3000:]
        for rank in (0, 1):  # every rank's transfer state as it stopped (followers report it to rank 0)
            assert f"tensor-parallel rank {rank} stopped: 0 open receives, 0 open sends, 0 quarantined pages" in log


# ---- a follower dies ---------------------------------------------------------------------------------
def _follower_pid(w: Proc) -> int:
    m = re.search(r"tensor-parallel rank 1 started \(pid (\d+)\)", w.log())
    assert m, w.log()[-2000:]
    return int(m.group(1))


def _assert_exits_with_clear_error(w: Proc, pid: int, t0: float) -> None:
    try:
        code = w.popen.wait(EXIT_S)
    except subprocess.TimeoutExpired:
        w.popen.kill()
        raise AssertionError(f"{w.name} still running {EXIT_S} s after its follower died:\n{w.log()[-3000:]}")
    assert code != 0
    assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in w.log()
    assert time.monotonic() - t0 < EXIT_S


def test_follower_killed_ends_the_worker(tiny):
    """Killed mid-generation: rank 0 is inside the step's collectives, which fail at once. Killed
    while the worker idles: only rank 0's monitor can notice. (Decode workers without a KV backend:
    the mechanism does not depend on the role, and NIXL agents are costly on a 2-core machine.)"""
    busy, idle = _worker("D3", "decode", 2, tiny, "none"), _worker("D4", "decode", 2, tiny, "none")
    try:
        _wait_ready([busy, idle], None, STARTUP_S)
        peer = Peer(busy.addr)
        spec = SamplingSpec(max_tokens=100000, temperature=0.0, ignore_eos=True)
        peer.sock.send(encode(GenerateRequest("long", SHORT, spec)))
        first = peer.recv(60)
        assert isinstance(first, TokenChunk) and first.token_ids and not first.finished
        for w in (busy, idle):
            pid = _follower_pid(w)
            os.kill(pid, signal.SIGKILL)
            _assert_exits_with_clear_error(w, pid, time.monotonic())
        peer.close()
    finally:
        _stop([busy, idle], grace_s=5)


# ---- the control plane on its own ---------------------------------------------------------------------
def _no_setup(*_: object) -> None:  # the stand-in follower below builds nothing
    raise AssertionError("not called")


def _echo_rank(spec) -> None:
    """A stand-in follower: answers each RX_POLL with the polled ids (as `released`)."""
    group = RankGroup.join(spec.rank, spec.world, spec.store_port, spec.args)
    while True:
        cmd = group.next_command(idle=lambda: None)
        if isinstance(cmd, tm.Shutdown):
            group.reply(tm.Bye(0, 0, 7))
            break
        group.reply(tm.Polled([len(cmd.request_ids)], [], cmd.request_ids))
    torch.distributed.destroy_process_group()


def test_control_plane_messages_larger_than_the_buffer():
    a = argparse.Namespace(tp=2, kv_backend="none", device="cpu", tp_timeout_s=30.0)
    with RankGroup.launch(a, "decode", "echo", setup=_no_setup, target=_echo_rank) as group:
        group.serving()
        for n in (3, 20000, 5):  # 20000 ids ~ 250 KB: both collectives take their overflow path
            ids = [f"request-{i:07d}" for i in range(n)]
            replies = group.call(tm.RxPoll(ids), lambda: tm.Polled([], [], []))
            assert replies[0] == tm.Polled([], [], []) and replies[1] == tm.Polled([n], [], ids)
    assert group.procs[0].exitcode == 0
