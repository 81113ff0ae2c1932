"""The TP control plane in one process: STEP's page protocol (rank 0 encoder -> follower mirror) and
how rank 0's proxies combine the ranks' transfer answers (MIN status, the failing rank's reason,
the other ranks aborted at once, pages handed back only once EVERY rank released them). Rank 0
is a real LocalKV over loopback endpoints; rank 1 answers from a script."""

from __future__ import annotations

import time

import pytest
import torch

from common.errors import WorkerUnavailable
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.tp import messages as tm
from engine.tp.local_kv import LocalKV
from engine.tp.proxies import GroupReceiver, GroupSender
from engine.tp.step import StepEncoder, StepMirror
from kv_transfer.interface import FailureReason, TransferConfig, TransferStatus
from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from model.config import preset
from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache

FAILED, WAITING = int(TransferStatus.FAILED), int(TransferStatus.WAITING)


def _spec(tp: int):
    return plan_kv_cache(preset("tiny"), 4 << 20, page_size=4, max_num_seqs=4, tp_size=tp, dtype=torch.float32)


def test_step_page_mirror_follows_rank0():
    """Deltas while pages only grow; the whole list again after release + regrow (preemption) and
    after a step the sequence sat out."""
    kv, enc, mirror = KVManager(_spec(1)), StepEncoder(), StepMirror()
    a = Sequence("a", list(range(10, 30)), SamplingParams(max_tokens=50))
    b = Sequence("b", list(range(40, 45)), SamplingParams(max_tokens=50))

    def step(*items: tuple[Sequence, int, int]) -> list[tm.StepSeq]:
        sched = []
        for seq, start, q in items:
            kv.grow(seq.pages, start + q)
            sched.append(ScheduledSeq(seq, start, q, start + q == seq.num_tokens))
        msg = tm.decode(tm.encode(enc.encode(sched, False)), tm.Step)
        ids, steps, rows = mirror.apply(msg)
        assert ids == [t for seq, start, q in items for t in seq.all_ids[start:start + q]]
        assert [(s.pages.full, s.pages.ring, s.start, s.q_len) for s in steps] == \
            [(seq.pages.full, seq.pages.ring, start, q) for seq, start, q in items]
        assert rows == [i for i, it in enumerate(sched) if it.sample]
        return msg.seqs

    assert step((a, 0, 12))[0].full_from == 0
    sa, sb = step((a, 12, 8), (b, 0, 5))
    assert (sa.full_from, len(sa.new_full), sb.full_from) == (3, 2, 0)  # a: a delta of 2 pages
    a.output_ids.append(7)
    assert step((a, 20, 1), (b, 0, 5))[0].full_from == 5
    n = len(a.pages.full)
    kv.release(a.pages)  # preempted and regrown to the same length: other page ids
    kv.grow(a.pages, n * 4)
    assert step((a, 0, 21))[0].full_from == 0
    assert step((b, 0, 5))[0].full_from == 0  # b sat out the last step


def test_prefix_hit_sliding_copies_reach_the_followers_once():
    """A prefix hit's first step carries its sliding copies (cached page -> ring page); the follower's
    SeqPages gets them for that step's forward only."""
    kv, enc, mirror = KVManager(_spec(1), "ident"), StepEncoder(), StepMirror()
    a = Sequence("a", list(range(10, 60)), SamplingParams(max_tokens=50))
    a.pages.copy_src, a.pages.copy_dst = [7, 8], [1, 2]
    kv.grow(a.pages, 50)
    (msg,) = tm.decode(tm.encode(enc.encode([ScheduledSeq(a, 40, 10, True)], False)), tm.Step).seqs
    assert (msg.copy_src, msg.copy_dst) == ([7, 8], [1, 2])
    _, steps, _ = mirror.apply(tm.Step([msg], False))
    assert (steps[0].pages.copy_src, steps[0].pages.copy_dst) == ([7, 8], [1, 2])
    a.pages.copy_src, a.pages.copy_dst = [], []
    a.output_ids.append(3)
    _, steps, _ = mirror.apply(tm.decode(tm.encode(enc.encode([ScheduledSeq(a, 50, 1, True)], False)), tm.Step))
    assert steps[0].pages.copy_src == [] and steps[0].pages.copy_dst == []


class ScriptedGroup:
    """Rank 0's group of two: rank 0 runs its share for real, rank 1 answers from `answers`."""

    world = 2

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.answers: list[object] = []

    def call(self, cmd, local):
        self.sent.append(cmd)
        return [local(), self.answers.pop(0)]


def test_step_with_tokens_still_on_the_device_asks_for_the_id_broadcast():
    """The overlapped loop: a decode input sampled by the step in flight is not on rank 0's host yet:
    the Step carries placeholders and ids_on_device, so followers take the [T] ids by broadcast."""
    kv, enc = KVManager(_spec(1)), StepEncoder()
    a = Sequence("a", [5, 6, 7], SamplingParams(max_tokens=50))
    b = Sequence("b", [8, 9], SamplingParams(max_tokens=50))
    kv.grow(a.pages, 4)
    kv.grow(b.pages, 2)
    known = enc.encode([ScheduledSeq(b, 0, 2, True)], False)
    assert not known.ids_on_device and known.seqs[0].token_ids == [8, 9]
    a.num_cached, a.num_pending = 3, 1  # its 4th token was sampled by the step in flight
    step = enc.encode([ScheduledSeq(a, 3, 1, True), ScheduledSeq(b, 0, 2, True)], False)
    assert step.ids_on_device and step.seqs[0].token_ids == [0] and step.seqs[1].token_ids == [8, 9]
    assert tm.decode(tm.encode(step)).ids_on_device  # it survives the control plane's codec


def test_receiver_proxy_min_status_first_cause_and_release_by_every_rank():
    group, hub = ScriptedGroup(), LoopbackHub()
    spec = _spec(2)
    rx = LoopbackReceiver(KVPool(spec), TransferConfig("dec", "m", 0, 2), hub)
    rx.set_rank_endpoints((rx.endpoint, "loopback://rank1"), (rx.epoch, 1))
    proxy = GroupReceiver(group, LocalKV(None, rx))
    pages = SeqPages([1, 2, 3], [0])
    group.answers.append(tm.Done(""))
    req = proxy.expect("r", pages, 10, time.time() + 30)
    assert req.request_id == "r" and req.decode_endpoints == (rx.endpoint, "loopback://rank1")

    group.answers.append(tm.Polled([WAITING], [], []))
    proxy.progress()
    assert proxy.poll("r") == TransferStatus.WAITING  # the snapshot of this progress(): no new command
    assert [type(c) for c in group.sent] == [tm.RxExpect, tm.RxPoll]

    # rank 1 fails (its writer died); rank 0 is still waiting -> FAILED, and rank 0 aborts at once
    group.answers += [tm.Polled([FAILED], [tm.Failure("r", int(FailureReason.PEER_DEAD), "prefill agent gone")], []),
                      tm.Done("")]
    assert proxy.poll("r") == TransferStatus.FAILED
    assert isinstance(group.sent[-1], tm.RxAbort) and group.sent[-1].request_ids == ["r"]
    assert rx.poll("r") == TransferStatus.FAILED
    o = proxy.outcome("r")
    assert o.reason == FailureReason.PEER_DEAD and o.detail == "tensor-parallel rank 1: prefill agent gone"

    group.answers.append(tm.Polled([FAILED], [], []))  # rank 0 releases, rank 1 not yet
    proxy.progress()
    assert proxy.take_releasable() == []
    group.answers.append(tm.Polled([FAILED], [], ["r"]))
    proxy.progress()
    (rel,) = proxy.take_releasable()
    assert rel.request_id == "r" and rel.pages is pages
    n = len(group.sent)
    proxy.progress()  # nothing tracked: no collective
    assert len(group.sent) == n


def _sender_proxy():
    """Rank 0's GroupSender over a loopback sender (prefill TP 2 -> decode TP 1), with a scripted
    group standing for the other rank; and the decode side's TransferRequest."""
    group, hub = ScriptedGroup(), LoopbackHub()
    dec = LoopbackReceiver(KVPool(_spec(1)), TransferConfig("dec", "m", 0, 1), hub)
    req = dec.expect("r", SeqPages([5, 6, 7], [1, 2, 3]), 10, time.time() + 30)
    tx = LoopbackSender(KVPool(_spec(2)), TransferConfig("pre", "m", 0, 2), hub)
    return group, req, tx, GroupSender(group, LocalKV(tx, None))


def test_sender_proxy_aborts_other_ranks_and_reports_the_first_cause():
    group, req, tx, proxy = _sender_proxy()
    src = SeqPages([1, 2, 3], [0, 1, 2])
    group.answers.append(tm.Done(""))
    proxy.start(req, src)
    group.answers += [tm.Statuses([FAILED]), tm.Done("")]
    assert proxy.poll("r") == TransferStatus.FAILED
    assert isinstance(group.sent[-1], tm.TxAbort)
    assert tx.poll("r") == TransferStatus.FAILED  # rank 0 stopped too
    group.answers.append(tm.Outcome(True, FAILED, int(FailureReason.DEADLINE), "late", 0, 1.0))
    o = proxy.finish("r")
    assert o.status == TransferStatus.FAILED and o.reason == FailureReason.DEADLINE
    assert o.detail == "tensor-parallel rank 1: late"


def test_sender_proxy_start_errors_name_the_rank():
    group, req, tx, proxy = _sender_proxy()
    group.answers.append(tm.Done("bad pages"))
    with pytest.raises(WorkerUnavailable, match="disagree"):  # rank 0 accepted what rank 1 refused
        proxy.start(req, SeqPages([1, 2, 3], [0, 1, 2]))
