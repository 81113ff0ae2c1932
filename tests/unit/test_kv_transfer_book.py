"""ReceiverBook: the decode side's fail-closed bookkeeping, driven event by event. Every failure
path ends with the pages back in a real KVManager's free pool, and only once no claimant can
still write into them."""

import pytest
import torch

from kv_transfer.interface import FailureReason, TransferStatus
from kv_transfer.messages import Claim, Ended, KVCompat, LayerDone
from kv_transfer.receiver_state import ReceiverBook
from model.kv_cache import KVCacheSpec, KVManager, SeqPages

SPEC = KVCacheSpec(8, 2, 4, torch.float32, 16, (1, 3), (0, 2), (32, 12))  # 4 layers, 2 heads per rank
EPOCH = 1000


def _setup(tp_rank=0, tp_size=1, deadline=10.0, n=40):
    compat = KVCompat.from_spec(SPEC, "m", tp_size)
    book = ReceiverBook(EPOCH, tp_rank, tp_size, compat)
    kv = KVManager(SPEC)
    pages = SeqPages()
    kv.grow(pages, n)
    book.expect("r", pages, n, deadline, now=0.0)
    return book, kv, compat


def _claim(compat, rank=0, tp=1, agent=None, epoch=5, rid="r", decode_epoch=EPOCH, engine="pre"):
    return Claim(rid, decode_epoch, agent or f"{engine}/{rank}/{epoch}", engine, epoch, rank, tp, b"", compat)


def _release_all(book, kv):
    for rel in book.take_releasable():
        kv.release(rel.pages)


def _layers(book, rank, agent, now=1.0, layers=(0, 1, 2, 3), epoch=EPOCH):
    return [book.on_layer_done(LayerDone("r", epoch, rank, (layer,), 100), agent, now) for layer in layers]


def test_happy_path_single_sender():
    book, kv, compat = _setup()
    c = _claim(compat)
    assert book.status("r") == TransferStatus.WAITING
    assert book.on_claim(c, 0.5).accepted
    assert book.status("r") == TransferStatus.TRANSFERRING
    _layers(book, 0, c.sender_agent, layers=(0, 1, 2))
    assert book.status("r") == TransferStatus.TRANSFERRING
    _layers(book, 0, c.sender_agent, layers=(3, 3))  # a duplicate notification counts once
    assert book.status("r") == TransferStatus.DONE
    out = book.outcome("r", 2.0)
    assert out.num_bytes == 400 and out.seconds == pytest.approx(1.0)
    book.tick(100.0)  # past the deadline: DONE stays DONE
    assert book.status("r") == TransferStatus.DONE and book.take_releasable() == []
    pages = book._reqs["r"].pages
    book.finish("r")
    kv.release(pages)
    kv.assert_all_free()


def test_one_notification_may_name_several_layers():
    """Protocol v2: a WRITE that carried a backlog of layers announces them in one LayerDone; its
    bytes count once, a repeat counts nothing, and a layer outside the model makes it stale."""
    book, kv, compat = _setup()
    c = _claim(compat)
    assert book.on_claim(c, 0.5).accepted
    assert book.on_layer_done(LayerDone("r", EPOCH, 0, (0, 1, 2), 300), c.sender_agent, 1.0)
    assert book.status("r") == TransferStatus.TRANSFERRING
    assert book.on_layer_done(LayerDone("r", EPOCH, 0, (0, 1, 2), 300), c.sender_agent, 1.1)  # repeat
    assert not book.on_layer_done(LayerDone("r", EPOCH, 0, (3, 4), 200), c.sender_agent, 1.2)  # no layer 4
    assert book.status("r") == TransferStatus.TRANSFERRING
    assert book.on_layer_done(LayerDone("r", EPOCH, 0, (3,), 100), c.sender_agent, 1.3)
    assert book.status("r") == TransferStatus.DONE and book.outcome("r", 2.0).num_bytes == 400
    pages = book._reqs["r"].pages
    book.finish("r")
    kv.release(pages)
    kv.assert_all_free()


def test_done_needs_every_overlapping_prefill_rank():
    # decode TP 1 <- prefill TP 2: two senders, each must deliver every layer.
    book, kv, compat = _setup()
    c0, c1 = _claim(compat, 0, 2), _claim(compat, 1, 2)
    assert book.on_claim(c0, 0.1).accepted and book.on_claim(c1, 0.1).accepted
    _layers(book, 0, c0.sender_agent)
    assert book.status("r") == TransferStatus.TRANSFERRING
    _layers(book, 1, c1.sender_agent)
    assert book.status("r") == TransferStatus.DONE


def test_claims_checked_against_head_ranges_and_tp():
    book, _, _ = _setup(tp_rank=1, tp_size=2)
    compat = book.compat
    # prefill TP 4 -> decode rank 1 of 2 holds global heads 2,3 = prefill ranks 2 and 3.
    r = book.on_claim(_claim(compat, 0, 4), 0.1)
    assert not r.accepted and r.reason == FailureReason.HANDSHAKE_MISMATCH
    assert book.status("r") == TransferStatus.FAILED  # a mis-assigned sender fails the request


def test_claim_before_expect_is_retried_and_late_claim_refused():
    compat = KVCompat.from_spec(SPEC, "m", 1)
    book = ReceiverBook(EPOCH, 0, 1, compat)
    reply = book.on_claim(_claim(compat), 0.0)
    assert not reply.accepted and reply.retry
    kv = KVManager(SPEC)
    pages = SeqPages()
    kv.grow(pages, 40)
    book.expect("r", pages, 40, 5.0, 0.0)
    book.tick(6.0)
    assert book.status("r") == TransferStatus.FAILED and book.outcome("r", 6).reason == FailureReason.DEADLINE
    late = book.on_claim(_claim(compat), 6.1)
    assert not late.accepted and not late.retry and late.reason == FailureReason.DEADLINE
    # Nobody was ever allowed to write: the pages come back at once.
    assert book.quarantined() == []
    _release_all(book, kv)
    kv.assert_all_free()
    again = book.on_claim(_claim(compat), 7.0)  # a forgotten request is refused, not retried
    assert not again.accepted and not again.retry


def test_deadline_after_claim_quarantines_until_the_sender_ends():
    book, kv, compat = _setup(deadline=5.0)
    c = _claim(compat)
    assert book.on_claim(c, 1.0).accepted
    _layers(book, 0, c.sender_agent, layers=(0,))
    book.tick(5.5)
    assert book.status("r") == TransferStatus.FAILED
    cancels = book.take_cancels()
    assert [(a, m.reason) for a, m in cancels] == [(c.sender_agent, FailureReason.DEADLINE)]
    assert book.take_releasable() == []
    (q,) = book.quarantined()
    assert q.waiting_on == (c.sender_agent,) and q.reason == FailureReason.DEADLINE
    # A late layer notification is stale, never applied.
    assert _layers(book, 0, c.sender_agent, layers=(1,)) == [False]
    # An Ended from someone else does not release; the claimant's does.
    assert not book.on_ended(Ended("r", EPOCH, "intruder", 0, False, None, ""), 6.0)
    assert book.quarantined()
    assert book.on_ended(Ended("r", EPOCH, c.sender_agent, 0, False, FailureReason.DEADLINE, "x"), 6.0)
    assert book.quarantined() == []
    _release_all(book, kv)
    kv.assert_all_free()


def test_stale_notifications_are_dropped():
    book, _, compat = _setup()
    c = _claim(compat)
    book.on_claim(c, 0.1)
    before = book.num_stale
    assert _layers(book, 0, c.sender_agent, epoch=EPOCH - 1) == [False] * 4  # another decode epoch
    assert _layers(book, 0, "someone-else") == [False] * 4  # not the claimant
    assert not book.on_layer_done(LayerDone("other", EPOCH, 0, (0,), 1), c.sender_agent, 1.0)  # unknown request
    assert not book.on_layer_done(LayerDone("r", EPOCH, 0, (16, 17), 1), c.sender_agent, 1.0)  # unknown layer
    assert book.num_stale == before + 10
    assert book.status("r") == TransferStatus.TRANSFERRING and book.outcome("r", 1).num_bytes == 0


def test_epoch_and_compat_mismatch():
    book, kv, compat = _setup()
    r = book.on_claim(_claim(compat, decode_epoch=EPOCH + 1), 0.1)
    assert not r.accepted and r.reason == FailureReason.EPOCH_MISMATCH
    assert book.status("r") == TransferStatus.WAITING  # a claim for another epoch is not about this request
    other = KVCompat.from_spec(KVCacheSpec(16, 2, 4, torch.float32, 16, (1, 3), (0, 2), (32, 12)), "m", 1)
    r = book.on_claim(_claim(other), 0.2)
    assert not r.accepted and r.reason == FailureReason.HANDSHAKE_MISMATCH and "page_size" in r.detail
    assert book.status("r") == TransferStatus.FAILED
    _release_all(book, kv)
    kv.assert_all_free()


def test_peer_dead_releases_and_cancels_the_others():
    book, kv, compat = _setup()
    c0, c1 = _claim(compat, 0, 2), _claim(compat, 1, 2)
    book.on_claim(c0, 0.1)
    book.on_claim(c1, 0.1)
    book.on_peer_dead(c0.sender_agent, "gone", 1.0)
    assert book.outcome("r", 1).reason == FailureReason.PEER_DEAD
    assert [a for a, _ in book.take_cancels()] == [c1.sender_agent]  # the survivor must stop
    assert book.take_releasable() == []  # ... and confirm before the pages move
    book.on_ended(Ended("r", EPOCH, c1.sender_agent, 1, False, FailureReason.PEER_DEAD, ""), 1.2)
    _release_all(book, kv)
    kv.assert_all_free()
    assert not book.on_claim(_claim(compat, 0, 2, agent=c0.sender_agent), 2.0).accepted  # dead stays dead


def test_sender_restart_proves_the_old_epoch_dead():
    book, kv, compat = _setup(deadline=50)
    old = _claim(compat, epoch=5)
    book.on_claim(old, 0.1)
    book.tick(51)  # failed and quarantined: the old sender may still write
    assert book.quarantined()
    # The same prefill rank comes back with a newer epoch (for some other request).
    book.on_claim(_claim(compat, epoch=9, rid="other"), 52)
    assert book.quarantined() == []
    _release_all(book, kv)
    kv.assert_all_free()
    r = book.on_claim(_claim(compat, epoch=5, rid="other"), 53)  # the old epoch is refused from now on
    assert not r.accepted and r.reason == FailureReason.EPOCH_MISMATCH


def test_abort_and_unclaimed_refusal():
    book, kv, compat = _setup()
    c = _claim(compat)
    book.on_claim(c, 0.1)
    book.abort("r", FailureReason.ABORTED, "client went away", 0.2)
    assert [m.reason for _, m in book.take_cancels()] == [FailureReason.ABORTED]
    book.abort("r", FailureReason.ABORTED, "", 0.3)  # idempotent
    assert book.take_cancels() == []
    book.on_ended(Ended("r", EPOCH, c.sender_agent, 0, False, FailureReason.ABORTED, ""), 0.4)
    _release_all(book, kv)
    # A prefill rank that refuses before it ever claimed (e.g. it found the layout incompatible).
    pages = SeqPages()
    kv.grow(pages, 10)
    book.expect("r2", pages, 10, 9.0, 1.0)
    book.on_ended(Ended("r2", EPOCH, "pre/0/5", 0, False, FailureReason.HANDSHAKE_MISMATCH, "dtype"), 1.1)
    assert book.outcome("r2", 1.1).reason == FailureReason.HANDSHAKE_MISMATCH
    _release_all(book, kv)
    kv.assert_all_free()


def test_abort_after_done_is_a_no_op():
    book, _, compat = _setup()
    c = _claim(compat)
    book.on_claim(c, 0.1)
    _layers(book, 0, c.sender_agent)
    book.abort("r", FailureReason.ABORTED, "", 2.0)
    assert book.status("r") == TransferStatus.DONE and book.take_cancels() == []
    book.finish("r")
    book2, _, _ = _setup(deadline=1.0)
    book2.tick(2.0)
    with pytest.raises(AssertionError, match="take_releasable"):
        book2.finish("r")  # failed pages only come back through take_releasable()


def test_status_order_supports_min_reduce():
    ranks = [TransferStatus.DONE, TransferStatus.TRANSFERRING, TransferStatus.DONE]
    assert min(ranks) == TransferStatus.TRANSFERRING
    assert min(ranks + [TransferStatus.FAILED]) == TransferStatus.FAILED
    assert min([TransferStatus.DONE] * 4) == TransferStatus.DONE
    assert [s.terminal for s in TransferStatus] == [True, False, False, True]
