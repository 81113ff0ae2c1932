import pytest

from common.errors import AdmissionRejected, WorkerUnavailable
from router.placement import FleetSnapshot, WorkerView, place


def w(addr, *, healthy=True, ready=True, queued=0, running=0, free=1000, max_seqs=64):
    return WorkerView(addr, healthy, ready, 0, queued, running, free, 16, max_seqs)


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
