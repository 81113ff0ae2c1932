"""The router's HTTP surface without workers: validation errors are OpenAI-style 4xx bodies, and a
fleet with no live decode worker answers 503 with a reason, fast (no hang)."""

import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from router.config import RouterConfig
from router.fleet import Discovery
from router.handlers import StopStrings
from router.main import make_app


@pytest.fixture(scope="module")
def client():
    cfg = RouterConfig(model_name="m", decode=("tcp://127.0.0.1:1",), poll_interval_s=0.2, max_model_len=2048)
    with TestClient(make_app(cfg, Discovery([], ["tcp://127.0.0.1:1"]))) as c:
        yield c


def chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body,status,param", [
    (chat(model="nope"), 404, "model"),
    (chat(max_tokens=-1), 400, "max_tokens"),
    (chat(max_tokens=5000), 400, "max_tokens"),
    (chat(temperature=5), 400, "temperature"),
    (chat(n=200), 400, "n"),
    (chat(messages=[]), 400, "messages"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), 400, "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]), 400, "tools"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400, "tools"),
    (chat(tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (chat(messages=[{"role": "user", "content": " x" * 3000}]), 400, "messages"),
    # content is text or text parts: an image part's error names the part, not the text branch
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content.0"),
])
def test_bad_requests_get_openai_errors(client, body, status, param):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and param in (err["param"] or err["message"])


def test_invalid_json_and_completions_errors(client):
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 999999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"model": "m", "prompt": ""})
    assert r.status_code == 400


def test_unknown_endpoints_and_methods_get_openai_errors(client):
    """An endpoint tandem does not serve (embeddings) or a wrong method answers in OpenAI's error shape, naming
    what is served, not FastAPI's {"detail": "Not Found"} (the openai client showed a bare 'Error code: 404')."""
    r = client.post("/v1/embeddings", json={"model": "m", "input": "hi"})
    err = r.json()["error"]
    assert r.status_code == 404 and err["type"] == "invalid_request_error" and err["code"] == 404
    assert "POST /v1/embeddings" in err["message"] and "/v1/chat/completions" in err["message"]
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]
    assert "allow" in r.headers


def test_no_worker_is_503_with_reason_not_a_hang(client):
    assert client.get("/ready").status_code == 503
    t0 = time.monotonic()
    r = client.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert r.status_code == 503 and "decode worker" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    m = client.get("/metrics").text
    assert 'tandem_requests_total{status="error"}' in m and 'tandem_queue_depth{phase="decode"}' in m


def test_stop_strings_hold_back_partial_matches():
    s = StopStrings(["END", "xyz"])
    out = [s.feed(t) for t in ["abc E", "N", "D tail"]]
    assert [hit for _, hit in out] == [False, False, True]
    assert "".join(o for o, _ in out) == "abc "  # everything before the stop string, nothing after
    s = StopStrings(["END"])
    assert s.feed("hello EN")[0] == "hello " and s.feed("X")[0] == "E" and s.flush() == "NX"


def test_router_never_imports_torch():
    code = "import sys, router.main, router.api, router.harmony; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
