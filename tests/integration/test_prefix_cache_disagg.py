"""Prefix caching across roles, in one process over the loopback KV backend (CPU, fp32): a
conversation's turns go prefill worker -> decode worker; decode says which prefix it holds and the
prefill worker ships only the pages after it, computing only what its own cache lacks; greedy
outputs equal the single-process engine's without caching; failed transfers still return pages."""

import time

import pytest
import torch

from decode_worker.engine import DecodeEngine
from engine.build import EngineConfig, build_engine_parts, model_fingerprint
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from kv_transfer.interface import TransferConfig
from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from model.kv_cache import PageGroup
from prefill_worker.engine import PrefillEngine
from wire.protocol import AdmitRequest, Admitted, Abort, GenerateRequest, PrefillRequest, SamplingSpec, StartDecode

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=4096)
SPEC = SamplingSpec(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(ckpt_factory):
    path = ckpt_factory("tiny")
    cfg = EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=16 << 20)
    dparts, pparts = build_engine_parts(cfg), build_engine_parts(cfg)
    hub = LoopbackHub()
    name = model_fingerprint(dparts.model)
    rx = LoopbackReceiver(dparts.pool, TransferConfig("dec", name), hub)
    tx = LoopbackSender(pparts.pool, TransferConfig("pre", name), hub)
    return DecodeEngine(dparts, rx), PrefillEngine(pparts, tx), path


def serve_turn(dec, pre, rid, prompt, spec=SPEC):
    """Admit -> prefill -> start -> decode until finished. Returns (admitted, prefill result, tokens)."""
    adm = dec.admit(b"r", AdmitRequest(rid, len(prompt), spec.max_tokens, 1, 30.0, list(prompt)))
    assert isinstance(adm, Admitted), adm
    res = pre.run(PrefillRequest(rid, list(prompt), spec, adm.kv_target, 30.0))
    assert res.ok, res.error
    assert dec.start(b"r", StartDecode(rid, list(prompt), spec, res.first_token, None, [])) is None
    out = [res.first_token]
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        dec.poll_transfers()
        for _, batch in dec.step():
            for c in batch.chunks:
                out += c.token_ids
                if c.finished:
                    return adm, res, out
    raise AssertionError("the turn did not finish")


def shipped_bytes(spec, first_token, n):
    """Bytes the plan writes for tokens [first_token, n) at TP 1."""
    from kv_transfer.plan import logical_pages

    return sum(len(logical_pages(g, n, spec.page_size, spec.sliding_window, first_token)) * spec.page_bytes(g)
               for g in PageGroup)


def test_prefix_disaggregated_turns_ship_only_new_pages_and_match_colocated(stack):
    dec, pre, path = stack
    g = torch.Generator().manual_seed(21)
    system = torch.randint(0, 201088, (300,), generator=g).tolist()
    prompt, outs, log = list(system), [], []
    for turn in range(4):
        prompt = prompt + torch.randint(0, 201088, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
        adm, res, toks = serve_turn(dec, pre, f"t{turn}", prompt)
        sp = res.split  # the compute time's parts (wire.protocol.ComputeSplit): host parts within it, no GPU
        assert sp is not None and sp.gpu_seconds == 0.0
        assert 0 < sp.admit_seconds and 0 <= sp.hook_seconds <= sp.launch_seconds
        assert sp.admit_seconds + sp.launch_seconds <= res.prefill_seconds
        outs.append(toks)
        log.append((len(prompt), adm.cached_tokens, res.cached_tokens, res.transfer_bytes))
        prompt = prompt + toks
    spec = dec.kv.spec
    for n, d_cached, p_cached, nbytes in log:
        assert nbytes == shipped_bytes(spec, d_cached, n), (n, d_cached, nbytes)
    assert log[0][1] == 0 and log[0][2] == 0
    for (n, d_cached, p_cached, _), (n_prev, *_rest) in zip(log[1:], log[:-1]):
        # decode holds the previous turn's prompt and answer (all but its last token), prefill the
        # previous prompt; both page-aligned
        assert d_cached >= n_prev + SPEC.max_tokens - 1 - 15 and d_cached % 16 == 0
        assert n_prev - 15 <= p_cached <= n_prev
    # greedy outputs equal the single-process engine without any cache
    ref = LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=16 << 20, enable_prefix_caching=False))
    p = list(system)
    g = torch.Generator().manual_seed(21)
    torch.randint(0, 201088, (300,), generator=g)
    for turn in range(4):
        p = p + torch.randint(0, 201088, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g).tolist()
        o = ref.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].output_ids
        assert o == outs[turn], turn
        p = p + o
    dec.kv.assert_all_free()
    pre.kv.assert_all_free()


def test_prefix_failed_transfer_returns_pages_and_keeps_cache(stack):
    dec, pre, _ = stack
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 201088, (200,), generator=g).tolist()
    _, _, out = serve_turn(dec, pre, "warm", prompt)
    before = dec.kv.num_free()
    nxt = prompt + out + [1, 2, 3, 4, 5]
    adm = dec.admit(b"r", AdmitRequest("doomed", len(nxt), 4, 1, 30.0, nxt))
    assert isinstance(adm, Admitted) and adm.cached_tokens > 0
    held = dec.pending["doomed"].pages.full[: adm.cached_tokens // 16]
    assert all(dec.kv.alloc[PageGroup.FULL].ref(p) >= 2 for p in held)  # cache + this request
    dec.abort("doomed", "client went away")
    for _ in range(50):
        dec.poll_transfers()
        if "doomed" not in dec.rx.book._reqs:
            break
    assert dec.kv.num_free() == before
    assert all(dec.kv.alloc[PageGroup.FULL].ref(p) == 1 for p in held)  # back to the cache alone
    dec.kv.assert_all_free()


def test_prefix_branch_prefill_worker_keeps_a_shared_system_prompt(stack):
    """Three new conversations with one system prompt through the prefill worker (engine/prefix_branch.py):
    the second keeps the system prompt's KV (its chunk ends there), the third computes only its own part;
    tokens equal the single-process engine's without a cache."""
    dec, pre, path = stack
    g = torch.Generator().manual_seed(33)
    system = torch.randint(0, 201088, (200,), generator=g).tolist()  # 12 complete blocks + 8 tokens
    prompts = [system + torch.randint(0, 201088, (30,), generator=g).tolist() for _ in range(3)]
    snaps = pre.kv.cache.stats.branch_snapshots
    got = [serve_turn(dec, pre, f"branch{i}", p) for i, p in enumerate(prompts)]
    assert [res.cached_tokens for _, res, _ in got] == [0, 0, 192]
    assert pre.kv.cache.stats.branch_snapshots == snaps + 1
    ref = LLM(EngineConfig(checkpoint=path, scheduler=SCHED, kv_cache_bytes=16 << 20, enable_prefix_caching=False))
    assert [toks for _, _, toks in got] == [o.output_ids for o in ref.generate(prompts, SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))]
    dec.kv.assert_all_free()
    pre.kv.assert_all_free()


def test_prefix_landed_shared_prompt_is_hit_by_a_later_choice(stack):
    """n > 1 on a decode worker: a prompt whose KV landed from the prefill worker, flagged share_prompt, is indexed
    between steps (its ring's blocks copied before the next launch); a later choice prefilled on the decode worker
    hits it and decodes the same greedy tokens."""
    import dataclasses

    dec, pre, _ = stack
    g = torch.Generator().manual_seed(44)
    prompt = torch.randint(0, 201088, (330,), generator=g).tolist()  # 20 complete blocks + 10 tokens
    _, _, first = serve_turn(dec, pre, "share0", prompt, dataclasses.replace(SPEC, share_prompt=True))
    assert dec.generate(b"r", GenerateRequest("share1", list(prompt), SPEC)) is None
    out, cached, done = [], None, False
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end and not done:
        for _, batch in dec.step():
            for c in batch.chunks:
                if c.request_id == "share1":
                    cached = c.cached_tokens if cached is None else cached
                    out += c.token_ids
                    done = done or c.finished
    assert cached == 320 and out == first  # every complete block
    dec.kv.assert_all_free()
    pre.kv.assert_all_free()
