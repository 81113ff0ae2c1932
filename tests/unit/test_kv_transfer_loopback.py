"""The loopback backend end to end in one process: byte-exact pages across TP splits, sliding tail
only, layer by layer, every failure path ending with all pages back in the free pools, and a tiny
gpt-oss whose decode continues with identical tokens after a disaggregated prefill."""

import dataclasses
import time

import pytest
import torch
from prometheus_client import REGISTRY

from common.errors import ConfigError, ProtocolError
from kv_transfer.factory import TransferBackend, create_receiver, create_sender
from kv_transfer.interface import FailureReason, TransferConfig, TransferStatus
from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from model.kv_cache import KVCacheSpec, KVManager, KVPool, PageGroup, SeqPages

TOTAL_HEADS = 4
LAYERS = (0, 1, 2, 3)


def spec_for(tp: int, *, page=8, window=32, pages=(48, 24), dtype=torch.float32) -> KVCacheSpec:
    return KVCacheSpec(page, TOTAL_HEADS // tp, 8, dtype, window, (1, 3), (0, 2), pages)


def random_pool(spec: KVCacheSpec, seed: int) -> KVPool:
    pool = KVPool(spec)
    g = torch.Generator().manual_seed(seed)
    for p in pool.pools:
        p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return pool


def scattered_pages(kv: KVManager, n_tokens: int, seed: int) -> SeqPages:
    """Reserve pages whose ids are not 0..k (allocate, free in shuffled order, allocate again)."""
    g = torch.Generator().manual_seed(seed)
    junk = SeqPages()
    kv.grow(junk, kv.spec.num_pages[0] * kv.spec.page_size // 2)
    for a, lst in zip(kv.alloc, (junk.full, junk.ring)):
        a.free([lst[i] for i in torch.randperm(len(lst), generator=g).tolist()])
    pages = SeqPages()
    kv.grow(pages, n_tokens)
    return pages


def expected_block(src_pools, src_pages, dst_tp, dst_rank, layer, spec_src, n_tokens, src_tp):
    """What decode rank `dst_rank` must hold for `layer`, built from plain indexing of every prefill
    rank's pool: [2, pages, heads of dst_rank, P, D] in logical page order (tail only for sliding)."""
    g, li = spec_src.group_of(layer)
    p, w = spec_src.page_size, spec_src.sliding_window
    end = -(-n_tokens // p)
    js = range(0, end) if g == PageGroup.FULL else range(max(0, n_tokens - w + 1) // p, end)
    r = -(-w // p) + 1
    heads = range(dst_rank * TOTAL_HEADS // dst_tp, (dst_rank + 1) * TOTAL_HEADS // dst_tp)
    out = []
    for j in js:
        per_head = []
        for h in heads:
            src_rank, local = divmod(h, TOTAL_HEADS // src_tp)
            pg = src_pages.full[j] if g == PageGroup.FULL else src_pages.ring[j % r]
            per_head.append(src_pools[src_rank].pools[g][li, :, pg, local])
        out.append(torch.stack(per_head, 1))  # [2, h, P, D]
    return torch.stack(out, 1), list(js)


def dst_block(pool, pages, layer, js):
    g, li = pool.spec.group_of(layer)
    r = -(-pool.spec.sliding_window // pool.spec.page_size) + 1
    ids = [pages.full[j] if g == PageGroup.FULL else pages.ring[j % r] for j in js]
    return pool.pools[g][li][:, ids]


@pytest.mark.parametrize("p,d", [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("n_tokens", [1, 31, 96, 100, 250])
def test_pages_land_byte_exact_across_tp(p, d, n_tokens):
    before = {role: _bytes(role) for role in ("prefill", "decode")}
    hub = LoopbackHub()
    dst = [KVPool(spec_for(d)) for _ in range(d)]
    dkv = KVManager(spec_for(d))
    rx = [LoopbackReceiver(dst[s], TransferConfig("dec", "m", s, d), hub) for s in range(d)]
    eps = tuple(r.endpoint for r in rx)
    for r in rx:
        r.set_rank_endpoints(eps, tuple(x.epoch for x in rx))
    dpages = scattered_pages(dkv, n_tokens, seed=n_tokens)
    reqs = [r.expect("q", dpages, n_tokens, time.time() + 30) for r in rx]
    src = [random_pool(spec_for(p), seed=100 + r) for r in range(p)]
    pkv = KVManager(spec_for(p))
    spages = scattered_pages(pkv, n_tokens, seed=7)
    tx = [LoopbackSender(src[r], TransferConfig("pre", "m", r, p), hub) for r in range(p)]
    for t in tx:
        t.start(reqs[0], spages)
    for layer in LAYERS:
        for t in tx:
            t.layer_done(layer)
        for s in range(d):
            for later in LAYERS[layer + 1:]:  # layer by layer: nothing of later layers yet
                want, js = expected_block(src, spages, d, s, later, spec_for(p), n_tokens, p)
                assert dst_block(dst[s], dpages, later, js).abs().sum() == 0
    assert min(t.poll("q") for t in tx) == TransferStatus.DONE
    assert min(r.poll("q") for r in rx) == TransferStatus.DONE
    for s in range(d):
        for layer in LAYERS:
            want, js = expected_block(src, spages, d, s, layer, spec_for(p), n_tokens, p)
            assert torch.equal(dst_block(dst[s], dpages, layer, js), want)
        # Sliding tail only: ring pages outside the tail stay untouched.
        r = -(-32 // 8) + 1
        tail = {j % r for j in range(max(0, n_tokens - 31) // 8, -(-n_tokens // 8))}
        for i, page in enumerate(dpages.ring):
            if i not in tail:
                assert dst[s].pools[PageGroup.SLIDING][:, :, page].abs().sum() == 0
    sent = sum(t.finish("q").num_bytes for t in tx)
    got = sum(r.finish("q").num_bytes for r in rx)
    assert sent == got == sum(x.element_size() * x.numel() for s in range(d) for layer in LAYERS
                              for x in [expected_block(src, spages, d, s, layer, spec_for(p), n_tokens, p)[0]])
    pkv.release(spages)
    dkv.release(dpages)
    for role in ("prefill", "decode"):
        assert _bytes(role) - before[role] == sent


def _bytes(role):
    return REGISTRY.get_sample_value("tandem_kv_transfer_bytes_total", {"role": role}) or 0.0


def _pair(hub=None, *, deadline=30.0, n=60, rx_spec=None, tx_spec=None):
    hub = hub or LoopbackHub()
    dspec, pspec = rx_spec or spec_for(1), tx_spec or spec_for(1)
    dkv, pkv = KVManager(dspec), KVManager(pspec)
    rx = LoopbackReceiver(KVPool(dspec), TransferConfig("dec", "m"), hub)
    tx = LoopbackSender(random_pool(pspec, 1), TransferConfig("pre", "m"), hub)
    dpages, spages = SeqPages(), SeqPages()
    dkv.grow(dpages, n)
    pkv.grow(spages, n)
    req = rx.expect("q", dpages, n, time.time() + deadline)
    return hub, rx, tx, dkv, pkv, dpages, spages, req


def _settle(rx, tx, dkv, pkv, spages):
    """The owners' side of a failed transfer: prefill frees after terminal, decode frees what the
    receiver hands back. Everything must end up free."""
    assert tx.poll("q") == TransferStatus.FAILED
    tx.finish("q")
    pkv.release(spages)
    for rel in rx.take_releasable():
        dkv.release(rel.pages)
    assert rx.quarantined() == []
    dkv.assert_all_free()
    pkv.assert_all_free()


def _failures(role, reason):
    return REGISTRY.get_sample_value("tandem_kv_transfer_failures_total", {"role": role, "reason": reason}) or 0.0


def test_deadline_fails_both_sides_and_frees_pages():
    before = _failures("decode", "deadline")
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair(deadline=2.0)  # room for a loaded machine
    tx.start(req, spages)
    tx.layer_done(0)
    assert rx.poll("q") == TransferStatus.TRANSFERRING
    time.sleep(2.1)  # prefill stalls past the deadline
    assert rx.poll("q") == TransferStatus.FAILED
    assert rx.outcome("q").reason == FailureReason.DEADLINE
    assert tx.poll("q") == TransferStatus.FAILED and tx.outcome("q").reason == FailureReason.DEADLINE
    _settle(rx, tx, dkv, pkv, spages)
    assert _failures("decode", "deadline") == before + 1


def test_decode_abort_stops_the_sender():
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair()
    tx.start(req, spages)
    tx.layer_done(0)
    rx.abort("q", detail="client disconnected")
    assert tx.poll("q") == TransferStatus.FAILED and tx.outcome("q").reason == FailureReason.ABORTED
    tx.layer_done(1)  # nothing more is written after the abort
    g, li = rx.pool.spec.group_of(1)
    assert rx.pool.pools[g][li].abs().sum() == 0
    _settle(rx, tx, dkv, pkv, spages)


def test_prefill_abort_fails_decode_fast():
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair()
    tx.start(req, spages)
    tx.abort("q", detail="prefill preempted")
    assert rx.poll("q") == TransferStatus.FAILED and rx.outcome("q").reason == FailureReason.ABORTED
    _settle(rx, tx, dkv, pkv, spages)


def test_epoch_mismatch_writes_nothing():
    hub, rx, tx, dkv, pkv, dpages, spages, req = _pair()
    stale = dataclasses.replace(req, decode_epochs=(req.decode_epochs[0] - 1,))  # made by a previous decode process
    tx.start(stale, spages)
    assert tx.poll("q") == TransferStatus.FAILED and tx.outcome("q").reason == FailureReason.EPOCH_MISMATCH
    assert all(p.abs().sum() == 0 for p in rx.pool.pools)
    assert rx.poll("q") == TransferStatus.WAITING  # the real request is untouched ...
    rx.abort("q")  # ... until its owner gives up on it
    _settle(rx, tx, dkv, pkv, spages)


def test_handshake_mismatch_is_refused_on_both_sides():
    bf16 = spec_for(1, dtype=torch.bfloat16)
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair(tx_spec=bf16)
    tx.start(req, spages)
    out = tx.outcome("q")
    assert out.status == TransferStatus.FAILED and out.reason == FailureReason.HANDSHAKE_MISMATCH
    assert "dtype" in out.detail
    assert rx.poll("q") == TransferStatus.FAILED and rx.outcome("q").reason == FailureReason.HANDSHAKE_MISMATCH
    _settle(rx, tx, dkv, pkv, spages)


def test_receiver_gone_is_peer_dead():
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair()
    tx.start(req, spages)
    rx.close()
    tx.layer_done(0)
    assert tx.poll("q") == TransferStatus.FAILED and tx.outcome("q").reason == FailureReason.PEER_DEAD
    tx.finish("q")
    pkv.release(spages)
    pkv.assert_all_free()


def test_malformed_request_raises_before_starting():
    _, rx, tx, dkv, pkv, dpages, spages, req = _pair()
    with pytest.raises(ProtocolError):
        tx.start(dataclasses.replace(req, full_pages=req.full_pages[:2]), spages)
    with pytest.raises(ProtocolError):
        tx.start(req, SeqPages(spages.full[:1], spages.ring))


def test_claim_retried_until_every_decode_rank_expects():
    hub = LoopbackHub()
    dst = [KVPool(spec_for(2)) for _ in range(2)]
    rx = [LoopbackReceiver(dst[s], TransferConfig("dec", "m", s, 2), hub) for s in range(2)]
    for r in rx:
        r.set_rank_endpoints(tuple(x.endpoint for x in rx), tuple(x.epoch for x in rx))
    pages = SeqPages([0, 1], [0, 1])
    req = rx[0].expect("q", pages, 10, time.time() + 10)  # rank 1 has not registered yet
    tx = LoopbackSender(random_pool(spec_for(1), 3), TransferConfig("pre", "m"), hub)
    tx.start(req, SeqPages([0, 1], [0, 1]))
    for layer in LAYERS:
        tx.layer_done(layer)
    assert tx.poll("q") == TransferStatus.TRANSFERRING  # rank 0 has everything, rank 1 nothing
    rx[1].expect("q", pages, 10, time.time() + 10)
    assert tx.poll("q") == TransferStatus.DONE
    assert [r.poll("q") for r in rx] == [TransferStatus.DONE] * 2


def test_factory():
    spec = spec_for(1)
    hub_rx = create_receiver(TransferBackend.LOOPBACK, KVPool(spec), TransferConfig("d", "m"))
    hub_tx = create_sender("loopback", KVPool(spec), TransferConfig("p", "m"))
    assert isinstance(hub_rx, LoopbackReceiver) and isinstance(hub_tx, LoopbackSender)
    hub_rx.close()
    hub_tx.close()
    with pytest.raises(ConfigError, match="unknown KV transfer backend"):
        create_sender("rdma", KVPool(spec), TransferConfig("p", "m"))
    with pytest.raises(ConfigError):
        TransferConfig("p", "m", tp_rank=2, tp_size=2)


# ---- a real model: decode continues exactly as if prefill had run locally -------------------------
def tiny_model():
    from kernels.registry import make_backends
    from model.config import preset
    from model.gpt_oss import GptOss
    from model.loader import load_weights
    from model.weights import RandomSource

    src = RandomSource(preset("tiny-a"), seed=0)
    model = GptOss(src.config, make_backends(), dtype=torch.float32)
    load_weights(model, src, progress=False)
    return model


def tiny_spec(model, page_size=4):
    from model.kv_cache import plan_kv_cache
    return plan_kv_cache(model.cfg, 4 << 20, page_size=page_size, max_num_seqs=4, dtype=torch.float32)


def prefill(model, pool, pages, prompt, on_layer_done=None) -> int:
    from model.context import SeqStep, build_step_meta
    meta = build_step_meta([SeqStep(pages, 0, len(prompt))], pool.spec)
    hidden = model(torch.tensor(prompt), meta, pool, on_layer_done)
    return int(model.compute_logits(hidden[meta.logits_indices]).argmax(-1))


def greedy_decode(model, pool, kv, pages, first: int, pos: int, n: int) -> list[int]:
    from model.context import SeqStep, build_step_meta
    out = [first]
    for _ in range(n):
        kv.grow(pages, pos + 1)
        meta = build_step_meta([SeqStep(pages, pos, 1)], pool.spec)
        hidden = model(torch.tensor(out[-1:]), meta, pool)
        out.append(int(model.compute_logits(hidden).argmax(-1)))
        pos += 1
    return out


def test_tiny_model_decode_after_loopback_prefill_matches_colocated():
    model = tiny_model()
    spec = tiny_spec(model)
    prompt = torch.randint(0, model.cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    # Reference: prefill and decode on one pool.
    ref_pool, ref_kv, ref_pages = KVPool(spec), KVManager(spec), SeqPages()
    ref_kv.grow(ref_pages, len(prompt))
    first = prefill(model, ref_pool, ref_pages, prompt)
    want = greedy_decode(model, ref_pool, ref_kv, ref_pages, first, len(prompt), 12)
    # Disaggregated: decode reserves (scattered) pages, prefill writes into them layer by layer.
    hub = LoopbackHub()
    dpool, dkv = KVPool(spec), KVManager(spec)
    dpages = scattered_pages(dkv, len(prompt), seed=3)
    rx = LoopbackReceiver(dpool, TransferConfig("dec", "tiny-a"), hub)
    req = rx.expect("q", dpages, len(prompt), time.time() + 30)
    ppool, pkv, ppages = KVPool(spec), KVManager(spec), SeqPages()
    pkv.grow(ppages, len(prompt))
    tx = LoopbackSender(ppool, TransferConfig("pre", "tiny-a"), hub)
    tx.start(req, ppages)
    first_d = prefill(model, ppool, ppages, prompt, on_layer_done=tx.layer_done)
    assert tx.poll("q") == TransferStatus.DONE and rx.poll("q") == TransferStatus.DONE
    tx.finish("q")
    rx.finish("q")
    pkv.release(ppages)
    got = greedy_decode(model, dpool, dkv, dpages, first_d, len(prompt), 12)
    assert got == want
    # Control: the same decode without the transferred KV goes elsewhere.
    blank, bkv = KVPool(spec), KVManager(spec)
    bpages = SeqPages()
    bkv.grow(bpages, len(prompt))
    assert greedy_decode(model, blank, bkv, bpages, first, len(prompt), 12) != want
