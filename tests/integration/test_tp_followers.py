"""Multi-rank workers (`--tp 2`) when a follower rank dies, and the ranks' control plane on its own
(split from tests/integration/test_tp_workers.py; process helpers in tests/support/tp_procs.py):
  - a follower killed mid-generation, or while its worker is idle, ends the worker with a clear
    error within seconds (no hang);
  - control-plane messages larger than the buffer (tests/unit/test_tp_control.py has the rest of
    the control plane in one process: STEP page deltas, combining the ranks' transfer answers).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from engine.tp import messages as tm
from engine.tp.group import RankGroup
from wire.protocol import GenerateRequest, SamplingSpec, TokenChunk, encode

from tests.support.tp_procs import SHORT, STARTUP_S, Peer, Proc, start_worker, stop, wait_ready

pytest.importorskip("nixl._api", reason="NIXL is not installed")

EXIT_S = 20  # a worker whose follower died must be gone within this


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


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
    busy, idle = start_worker("D3", "decode", 2, tiny, "none"), start_worker("D4", "decode", 2, tiny, "none")
    try:
        wait_ready([busy, idle], None, STARTUP_S)
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
        stop([busy, idle], grace_s=5)


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
