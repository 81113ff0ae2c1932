"""Multi-rank workers (`--tp 2`) as real processes on the CPU (gloo between ranks, KV over NIXL/UCX
TCP loopback), on the embedded-style tiny model (2 KV heads: TP 2 gives each rank one head).

Shown, greedy outputs always equal to the single-process engine:
  - the router with a TP-2 prefill worker and a TP-2 decode worker serves the unmodified openai
    client (chat, stream, completions with logprobs, concurrent streams);
  - the prefill/decode TP mixes (1,2), (2,1), (2,2) over the router's wire protocol (the test plays the
    router: Admit -> Prefill -> StartDecode), short and longer-than-the-window prompts (prefilled in
    two chunks by the TP-2 workers, whose prefill and mixed steps run piecewise), plus a colocated request
    that prefills on the TP-2 decode worker;
    the TP-2 decode worker's lm_head is vocab-parallel (an all-gather of the logits every rank joins);
  - prompt logprobs from both TP-2 workers (vocab-parallel and replicated lm_head);
  - afterwards every page is back (rank 0 owns allocation for all ranks) and, on a graceful stop,
    every rank reports no open transfer and no quarantined page.
A follower that dies, and the control plane's large messages: tests/integration/test_tp_followers.py (the
process helpers are in tests/support/tp_procs.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from dataclasses import dataclass

import pytest
import torch
from openai import OpenAI

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from router.chat_types import ChatMessage, ChatPrompt
from router.harmony import HarmonyFormat
from wire.protocol import (Abort, AdmitRequest, Admitted, GenerateRequest, PrefillRequest, PrefillResult,
                             SamplingSpec, StartDecode, TokenChunk, encode)
from router.tokenizer import CALL, RETURN

from tests.support.ports import free_port
from tests.support.tp_procs import SHORT, STARTUP_S, Peer, Proc, spawn, start_worker, stop, wait_ready

pytest.importorskip("nixl._api", reason="NIXL is not installed")


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
    # ... through piecewise pieces (on a CPU they run directly on their static buffers, as captured ones would on a
    # GPU): TP-sharded buffers, the all-reduces inside pieces, each rank's per-layer KV hooks between them
    chunked += ("--piecewise-graphs",)
    workers = {"P1": start_worker("P1", "prefill", 1, tiny),
               "P2": start_worker("P2", "prefill", 2, tiny, extra=chunked),
               "D1": start_worker("D1", "decode", 1, tiny),
               "D2": start_worker("D2", "decode", 2, tiny, extra=chunked + ("--vocab-parallel",))}
    port = free_port()
    router = spawn("router", ["router", "--host", "127.0.0.1", "--port", str(port), "--model-name", "m",
                              "--prefill", workers["P2"].addr, "--decode", workers["D2"].addr,
                              "--poll-interval-s", "0.25"])
    c = Cluster(workers, router, f"http://127.0.0.1:{port}")
    procs = [router, *workers.values()]
    try:
        wait_ready(procs, c.url, STARTUP_S)
        yield c
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(EngineConfig(checkpoint=tiny, kv_cache_bytes=64 << 20))

    def run(prompt_ids: list[int], max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=not stop, stop_token_ids=stop)
        return llm.generate([prompt_ids], sp)[0].output_ids

    return run


SPEC = SamplingSpec(max_tokens=10, temperature=0.0, ignore_eos=True)
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
    stop([cluster.router, *cluster.workers.values()])  # SIGTERM: each drains, rank 0 stops its followers
    for w in (cluster.workers["P2"], cluster.workers["D2"]):
        log = w.log()
        assert w.popen.returncode == 0, log[-3000:]
        assert log.count("piecewise pieces: ") == 2, log[-3000:]  # both ranks stepped through pieces
        for rank in (0, 1):  # every rank's transfer state as it stopped (followers report it to rank 0)
            assert f"tensor-parallel rank {rank} stopped: 0 open receives, 0 open sends, 0 quarantined pages" in log
