"""Failures surface as clear errors, never hangs: a dead worker gives a 503 with a reason within
seconds, and a stream whose decode worker dies mid-generation ends with an error event."""

import signal
import time

import httpx
import pytest

from tests.support.service import start_service


@pytest.fixture(scope="module")
def svc(ckpt_factory):
    s = start_service(ckpt_factory("tiny"))
    yield s
    s.stop()


def chat(url, **kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_prefill_down_then_decode_down(svc):
    assert chat(svc.url).status_code == 200
    prefill, decode, router = svc.procs[0], svc.procs[1], svc.procs[2]
    prefill.send_signal(signal.SIGKILL)
    prefill.wait()
    t0 = time.monotonic()
    # a new prompt: the first one's prefix is cached on the decode worker, which would prefill it itself
    r = chat(svc.url, messages=[{"role": "user", "content": "a different question " * 40}])
    assert r.status_code == 503, r.text
    assert "prefill" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 20
    deadline = time.monotonic() + 15
    while httpx.get(svc.url + "/ready").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(svc.url + "/ready").json()["reason"]
    decode.send_signal(signal.SIGKILL)
    decode.wait()
    deadline = time.monotonic() + 15
    while "decode" not in httpx.get(svc.url + "/ready").json()["reason"] and time.monotonic() < deadline:
        time.sleep(0.2)
    t0 = time.monotonic()
    r = chat(svc.url, stream=True)
    # Streaming requests fail before the first byte with a status code, not a hung stream.
    assert r.status_code == 503 and "decode worker" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert router.poll() is None  # the router itself stays up
