"""FP8 KV pages over the KV transfer (loopback backend, in process): e4m3 pages are bytes and land
byte-exact across TP splits at half the bytes of bf16; both sides must agree on the KV dtype and on
the FP8 scale table, or the handshake refuses with a clear error and every page comes back; a tiny
gpt-oss decodes the same tokens after a disaggregated FP8 prefill as with a colocated one.
(The NIXL flavour of the refusal runs between real processes in tests/integration/test_fp8_kv.py.)"""

import time

import torch

from kv_transfer.interface import FailureReason, TransferConfig, TransferStatus
from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from kv_transfer.messages import Claim, KVCompat, decode, encode
from model.kv_cache import KVManager, KVPool, SeqPages
from model.kv_scales import KVScales
from tests.unit.test_kv_transfer_loopback import (LAYERS, TOTAL_HEADS, dst_block, expected_block, greedy_decode,
                                                  prefill, scattered_pages, spec_for, tiny_model)

FP8 = torch.float8_e4m3fn


def fp8_pool(spec, seed, scales=None, kv_heads=None):
    pool = KVPool(spec, scales=scales, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(seed)
    for p in pool.pools:  # random bytes, NaN codes excluded (0x7f / 0xff)
        b = torch.randint(0, 255, p.shape, generator=g, dtype=torch.uint8)
        p.view(torch.uint8).copy_(torch.where((b & 0x7F) == 0x7F, b ^ 1, b))
    return pool


def _pair(rx_pool, tx_pool, n=60):
    hub = LoopbackHub()
    dkv, pkv = KVManager(rx_pool.spec), KVManager(tx_pool.spec)
    rx = LoopbackReceiver(rx_pool, TransferConfig("dec", "m"), hub)
    tx = LoopbackSender(tx_pool, TransferConfig("pre", "m"), hub)
    dpages, spages = SeqPages(), SeqPages()
    dkv.grow(dpages, n)
    pkv.grow(spages, n)
    return rx, tx, dkv, pkv, spages, rx.expect("q", dpages, n, time.time() + 30)


def _refused(rx, tx, dkv, pkv, spages, req) -> str:
    tx.start(req, spages)
    out = tx.outcome("q")
    assert out.status == TransferStatus.FAILED and out.reason == FailureReason.HANDSHAKE_MISMATCH
    assert rx.poll("q") == TransferStatus.FAILED and rx.outcome("q").reason == FailureReason.HANDSHAKE_MISMATCH
    assert all(p.view(torch.uint8).sum() == 0 for p in rx.pool.pools)  # nothing was written
    tx.finish("q")
    pkv.release(spages)
    for rel in rx.take_releasable():
        dkv.release(rel.pages)
    dkv.assert_all_free()
    pkv.assert_all_free()
    return out.detail


def test_fp8_kv_handshake_refuses_a_bf16_peer():
    rx, tx, dkv, pkv, spages, req = _pair(KVPool(spec_for(1, dtype=FP8)), KVPool(spec_for(1, dtype=torch.bfloat16)))
    detail = _refused(rx, tx, dkv, pkv, spages, req)
    # the decode side refuses the claim, in its own words ("here" = decode)
    assert "dtype: 'float8_e4m3fn' here vs 'bfloat16' at the peer" in detail, detail
    assert "kv_scales: 'default' here vs 'none' at the peer" in detail, detail


def test_fp8_kv_handshake_refuses_other_scales():
    spec = spec_for(1, dtype=FP8)
    calibrated = KVScales.from_amax(torch.full((4, TOTAL_HEADS), 3.0), torch.full((4, TOTAL_HEADS), 0.5), "calibrated:2")
    rx, tx, dkv, pkv, spages, req = _pair(KVPool(spec), KVPool(spec, scales=calibrated))
    detail = _refused(rx, tx, dkv, pkv, spages, req)
    assert "kv_scales: 'default' here vs 'calibrated:2:" in detail, detail
    assert "dtype" not in detail


def test_fp8_kv_scale_tags_agree_across_tp_splits_and_travel_in_the_handshake():
    g = torch.Generator().manual_seed(0)
    scales = KVScales(torch.rand(4, TOTAL_HEADS, generator=g) + 0.1, torch.rand(4, TOTAL_HEADS, generator=g) + 0.1,
                      "checkpoint")
    spec2 = spec_for(2, dtype=FP8)
    ranks = [KVPool(spec2, scales=scales, kv_heads=range(2 * r, 2 * r + 2)) for r in range(2)]
    whole = KVPool(spec_for(1, dtype=FP8), scales=scales)
    assert {p.scales_tag for p in ranks} == {whole.scales_tag} and whole.scales_tag.startswith("checkpoint:")
    assert torch.equal(torch.cat([p.k_scale for p in ranks], dim=1), whole.k_scale)
    assert torch.equal(ranks[1].layer_scales(2)[1], scales.v[2, 2:4])
    compat = KVCompat.from_pool(whole, "m", 1)
    claim = Claim("r", 1, "agent", "eng", 2, 0, 1, b"", compat)
    assert decode(encode(claim), Claim).compat == compat and compat.kv_scales == whole.scales_tag
    # default tables are "default" whatever shape a rank built
    assert KVPool(spec2).scales_tag == KVPool(spec_for(1, dtype=FP8)).scales_tag == "default"
    assert KVPool(spec_for(1)).scales_tag == "none" and KVPool(spec_for(1)).layer_scales(0) is None


def test_fp8_kv_pages_land_byte_exact_across_tp_at_half_the_bytes():
    n_tokens = 100
    sent = {}
    for dtype in (FP8, torch.bfloat16):
        for p, d in ((1, 2), (2, 1)):
            hub = LoopbackHub()
            dst = [KVPool(spec_for(d, dtype=dtype)) for _ in range(d)]
            dkv = KVManager(spec_for(d, dtype=dtype))
            rx = [LoopbackReceiver(dst[s], TransferConfig("dec", "m", s, d), hub) for s in range(d)]
            for r in rx:
                r.set_rank_endpoints(tuple(x.endpoint for x in rx), tuple(x.epoch for x in rx))
            dpages = scattered_pages(dkv, n_tokens, seed=1)
            req = [r.expect("q", dpages, n_tokens, time.time() + 30) for r in rx][0]
            src = [fp8_pool(spec_for(p, dtype=dtype), 10 + r, kv_heads=range(r * TOTAL_HEADS // p, (r + 1) * TOTAL_HEADS // p))
                   if dtype == FP8 else KVPool(spec_for(p, dtype=dtype)) for r in range(p)]
            pkv = KVManager(spec_for(p, dtype=dtype))
            spages = scattered_pages(pkv, n_tokens, seed=2)
            tx = [LoopbackSender(src[r], TransferConfig("pre", "m", r, p), hub) for r in range(p)]
            for t in tx:
                t.start(req, spages)
            for layer in LAYERS:
                for t in tx:
                    t.layer_done(layer)
            assert min(t.poll("q") for t in tx) == TransferStatus.DONE
            for s in range(d):
                for layer in LAYERS:
                    want, js = expected_block(src, spages, d, s, layer, spec_for(p, dtype=dtype), n_tokens, p)
                    assert torch.equal(dst_block(dst[s], dpages, layer, js).view(torch.uint8), want.view(torch.uint8))
            sent[(dtype, p, d)] = sum(t.finish("q").num_bytes for t in tx)
    for p, d in ((1, 2), (2, 1)):
        assert 2 * sent[(FP8, p, d)] == sent[(torch.bfloat16, p, d)] > 0


def test_fp8_kv_tiny_model_decode_after_loopback_prefill_matches_colocated():
    """Disaggregated (prefill -> loopback -> decode) with FP8 KV equals colocated FP8 KV token for
    token: the decode worker reads exactly the bytes (and scales) its own prefill would have written."""
    from model.kv_cache import plan_kv_cache

    model = tiny_model()
    spec = plan_kv_cache(model.cfg, 4 << 20, page_size=4, max_num_seqs=4, dtype=FP8)
    scales = KVScales.from_amax(torch.full((4, 4), 5.0), torch.full((4, 4), 2.0), "calibrated:1")
    prompt = torch.randint(0, model.cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    ref_pool, ref_kv, ref_pages = KVPool(spec, scales=scales), KVManager(spec), SeqPages()
    ref_kv.grow(ref_pages, len(prompt))
    first = prefill(model, ref_pool, ref_pages, prompt)
    want = greedy_decode(model, ref_pool, ref_kv, ref_pages, first, len(prompt), 12)
    hub = LoopbackHub()
    dpool, dkv = KVPool(spec, scales=scales), KVManager(spec)
    dpages = scattered_pages(dkv, len(prompt), seed=3)
    rx = LoopbackReceiver(dpool, TransferConfig("dec", "tiny-a"), hub)
    req = rx.expect("q", dpages, len(prompt), time.time() + 30)
    ppool, pkv, ppages = KVPool(spec, scales=scales), KVManager(spec), SeqPages()
    pkv.grow(ppages, len(prompt))
    tx = LoopbackSender(ppool, TransferConfig("pre", "tiny-a"), hub)
    tx.start(req, ppages)
    first_d = prefill(model, ppool, ppages, prompt, on_layer_done=tx.layer_done)
    assert tx.poll("q") == TransferStatus.DONE and rx.poll("q") == TransferStatus.DONE
    tx.finish("q")
    rx.finish("q")
    pkv.release(ppages)
    pkv.assert_all_free()
    assert first_d == first
    assert greedy_decode(model, dpool, dkv, dpages, first_d, len(prompt), 12) == want
    dkv.release(dpages)
    dkv.assert_all_free()
