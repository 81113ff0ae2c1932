"""The IPC data path (TransferBackend.IPC) on GPUs: two real processes, NIXL as the control plane,
the decode pools exported with CUDA IPC and written by the prefill process's Triton copy kernel.
Prefill on cuda:0 and decode on cuda:1 (peer access over NVLink; needs 2 GPUs), and both on
cuda:0 (CUDA IPC between processes of one GPU; runs on one). Deselected by default (marker gpu):

  python -m pytest -m gpu tests/integration/test_kv_transfer_ipc_gpu.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kv_transfer.interface import FailureReason
from tests.support.nixl_cluster import Cluster, Scenario, _assert_done

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

PLACEMENTS = [pytest.param(("cuda:0", "cuda:1"), id="gpu0-gpu1"), pytest.param(("cuda:0", "cuda:0"), id="same-gpu")]


def _need(devices: tuple[str, str]) -> None:
    if max(int(d.split(":")[1]) for d in devices) >= torch.cuda.device_count():
        pytest.skip(f"needs {devices[1]}")


@pytest.mark.parametrize("devices", PLACEMENTS)
@pytest.mark.parametrize("p,d", [(1, 1), (1, 2)], ids=["p=d", "p<d"])
def test_pages_land_byte_exact_through_cuda_ipc(devices, p, d):
    _need(devices)
    sc = Scenario(p=p, d=d, n_tokens=100, pause_after=1, check_partial=True, data_path="ipc", devices=devices)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused", p)
        for q in c.dctl:
            q.put("check")
        c.expect("checked", d)
        for q in c.pctl:
            q.put("go")
        results = c.results()
    _assert_done(results, sc)
    for s in range(d):
        assert results[("decode", s)].partial_ok, "layers must land one by one"
    for r in range(p):
        assert set(results[("prefill", r)].paths.values()) == {"ipc"}, results[("prefill", r)]


@pytest.mark.parametrize("devices", PLACEMENTS)
def test_receiver_killed_mid_cuda_ipc_transfer(devices):
    _need(devices)
    sc = Scenario(pause_after=1, deadline_s=20.0, check_partial=True, data_path="ipc", devices=devices)
    with Cluster(sc) as c:
        c.wire()
        c.expect("paused")
        c.dctl[0].put("check")
        c.expect("checked")
        os.kill(c.dec[0].pid, signal.SIGKILL)
        time.sleep(0.2)
        c.pctl[0].put("go")  # the next layers are copied into the dead process's pool, then notified
        (_, _, r), = c.expect("result")
    assert r.role == "prefill" and r.status == "FAILED" and r.reason == FailureReason.PEER_DEAD.name, r
    assert r.seconds_to_terminal < sc.deadline_s / 2 and r.all_free, r
