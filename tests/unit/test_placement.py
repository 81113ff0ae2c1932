import pytest

from common.errors import AdmissionRejected, InvalidRequest, WorkerLate, WorkerUnavailable
from router.placement import FleetSnapshot, WorkerView, is_late, place


def w(addr, *, healthy=True, ready=True, queued=0, running=0, free=1000, max_seqs=64, late=False):
    return WorkerView(addr, healthy, ready, 0, queued, running, free, 16, max_seqs, late=late)


def test_decode_by_room_then_load_prefill_by_queued_tokens():
    fleet = FleetSnapshot(prefill=(w("p1", queued=5000), w("p2", queued=100), w("p3", queued=0, healthy=False)),
                          decode=(w("d1", free=500, running=3), w("d2", free=900, running=10), w("d3", free=2000, ready=False)))
    p = place(1000, 100, fleet)
    assert (p.decode, p.prefill) == ("d2", "p2")
    assert place(1000, 100, fleet, exclude=frozenset({"d2", "p2"})) == type(p)("d1", "p1")


def test_colocated_and_no_prefill_fleet():
    fleet = FleetSnapshot(prefill=(), decode=(w("d1"),))
    assert place(10, 10, fleet).prefill is None
    assert place(10, 10, FleetSnapshot((w("p1"),), (w("d1"),)), colocated=True).prefill is None


def test_errors_distinguish_down_from_full():
    with pytest.raises(WorkerUnavailable, match="decode"):
        place(10, 10, FleetSnapshot((w("p1"),), (w("d1", healthy=False),)))
    with pytest.raises(AdmissionRejected, match="KV room"):
        place(10_000, 10, FleetSnapshot((w("p1"),), (w("d1", free=100),)))
    with pytest.raises(AdmissionRejected):
        place(10, 10, FleetSnapshot((w("p1"),), (w("d1", running=64),)))
    with pytest.raises(WorkerUnavailable, match="prefill"):
        place(10, 10, FleetSnapshot((w("p1", ready=False),), (w("d1"),)))


def test_prefill_backlog_bound_and_retry_on_the_only_worker():
    busy = FleetSnapshot(prefill=(WorkerView("p1", True, True, 4, 400, 0, 1000, 16, 64),
                                  WorkerView("p2", True, True, 1, 900, 0, 1000, 16, 64)), decode=(w("d1"),))
    assert place(10, 10, busy, max_prefill_queue=4).prefill == "p2"  # p1 is at the bound, despite fewer tokens
    assert place(10, 10, busy).prefill == "p1"
    full = FleetSnapshot(prefill=(WorkerView("p1", True, True, 4, 400, 0, 1000, 16, 64),), decode=(w("d1"),))
    with pytest.raises(AdmissionRejected, match="prefill"):
        place(10, 10, full, max_prefill_queue=4)
    # excluded (it failed this request once) but the only live one: retried there rather than refused
    one = FleetSnapshot(prefill=(w("p1"),), decode=(w("d1"),))
    assert place(10, 10, one, exclude=frozenset({"p1", "d1"})) == type(place(10, 10, one))("d1", "p1")
    with pytest.raises(InvalidRequest):  # larger than the whole KV cache of every decode worker
        place(2000, 100, FleetSnapshot((w("p1"),), (WorkerView("d1", True, True, 0, 0, 0, 100, 16, 64, 100),)))


@pytest.mark.parametrize("healthy,was_ready,ago_s,disconnected,late", [
    (True, True, 0.5, False, False),    # live: nothing to wait for, it is placed on
    (False, True, 5.0, False, True),    # missed its polls, answered ready 5 s ago: late
    (False, True, 29.9, False, True),
    (False, True, 30.0, False, False),  # the grace period is over: gone
    (False, False, 1.0, False, False),  # its last answer said not ready (loading, draining): gone
    (False, True, 1.0, True, False),    # its connection dropped since (exited or restarted): gone
    (False, True, float("inf"), False, False),  # never answered
])
def test_late_is_missed_polls_within_the_grace_after_a_ready_answer(healthy, was_ready, ago_s, disconnected, late):
    assert is_late(healthy=healthy, was_ready=was_ready, answered_ago_s=ago_s, disconnected=disconnected,
                   grace_s=30.0) is late
    assert not is_late(healthy=healthy, was_ready=was_ready, answered_ago_s=ago_s, disconnected=disconnected,
                       grace_s=0.0)  # 0: no grace


def test_a_late_role_waits_a_gone_role_is_503():
    late_d = w("d1", healthy=False, late=True)
    gone_d = w("d1", healthy=False)
    # the only decode worker is late: wait (an AdmissionRejected, so the queue holds the request)
    with pytest.raises(WorkerLate, match="decode") as e:
        place(10, 10, FleetSnapshot((w("p1"),), (late_d,)))
    assert isinstance(e.value, AdmissionRejected)
    with pytest.raises(WorkerLate, match="prefill"):
        place(10, 10, FleetSnapshot((w("p1", healthy=False, late=True),), (w("d1"),)))
    # one role gone: 503 whatever the other does (waiting could not help)
    with pytest.raises(WorkerUnavailable, match="prefill"):
        place(10, 10, FleetSnapshot((w("p1", healthy=False),), (late_d,)))
    with pytest.raises(WorkerUnavailable, match="decode"):
        place(10, 10, FleetSnapshot((w("p1", healthy=False, late=True),), (gone_d,)))
    # a live worker is used and a late one ignored; colocated needs no prefill worker at all
    mixed = FleetSnapshot((w("p1", healthy=False, late=True), w("p2")), (late_d, w("d2")))
    assert place(10, 10, mixed) == type(place(10, 10, mixed))("d2", "p2")
    assert place(10, 10, FleetSnapshot((w("p1", healthy=False),), (w("d1"),)), colocated=True).prefill is None
