"""The router's edge without workers: body-size limit (413 before parsing, Content-Length and
chunked), length bounds before the tokenizer (400, never a 5xx, never a panic), API keys (401 with
OpenAI's invalid_api_key; probes stay open), the OpenAPI schema, and the drain gate (503)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.config import RouterConfig
from router.fleet import Discovery
from router.main import make_app, parse_args
from router.textguard import MAX_CHARS_PER_TOKEN, MAX_RUN_CHARS, check_texts
from router.tokenizer import load_encoding

DEAD = "tcp://127.0.0.1:1"


def app_with(**kw):
    cfg = RouterConfig(model_name="m", decode=(DEAD,), poll_interval_s=0.2, max_model_len=4096, **kw)
    return make_app(cfg, Discovery([], [DEAD]))


@pytest.fixture(scope="module")
def client():
    with TestClient(app_with(max_request_bytes=1 << 20)) as c:
        yield c


def chat(content="hi", **kw):
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def test_oversized_bodies_get_413_before_parsing(client):
    big = b'{"model": "m", "prompt": "' + b"x" * (2 << 20) + b'"}'
    r = client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and "limit" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit is enforced while the body streams in
        yield b'{"model": "m", "prompt": "'
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}'
    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.get("/health").status_code == 200


def test_long_inputs_are_400_before_the_tokenizer(client):
    # a run the tokenizer would take quadratic time on (and overflow its regex stack at ~1M)
    for text in ["a" * (MAX_RUN_CHARS + 1), " " * 50_000, "\u4e2d" * 30_000, "x" + "\u0301" * 5000]:
        r = client.post("/v1/chat/completions", json=chat(text))
        assert r.status_code == 400 and "run of" in r.json()["error"]["message"], r.text[:200]
    # more tokens than the context: 400 after tokenising (ordinary words), and for a token-id prompt
    r = client.post("/v1/chat/completions", json=chat("hello " * 5000))
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1000] * 5000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # the field this endpoint takes
    # characters that can only exceed the context: refused without tokenising
    with pytest.raises(Exception, match="more than"):
        check_texts([("prompt", "ab " * (4096 * MAX_CHARS_PER_TOKEN // 3 + 1))], 4096)


def test_longest_token_bound_holds():
    enc = load_encoding()
    longest = max(len(enc.decode([i])) for i in range(0, 199998, 1))
    assert longest == MAX_CHARS_PER_TOKEN


def test_api_keys_guard_v1_only():
    with TestClient(app_with(api_keys=("k1", "k2"))) as c:
        for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}):
            r = c.post("/v1/chat/completions", json=chat(), headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"authorization": "Bearer k2"}).status_code == 200
        r = c.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer k1"})
        assert r.status_code == 503  # past the key check: no worker
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        assert c.get("/ready").status_code == 503  # open, and honest: no worker


def test_api_keys_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEYS", "e1, e2")
    cfg, _ = parse_args(["--decode", DEAD, "--api-key", "f1"])
    assert cfg.api_keys == ("f1", "e1", "e2") and "f1" not in repr(cfg)


def test_openapi_schema_describes_the_request_bodies(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("ChatCompletionRequest")
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "max_tokens", "priority", "stream"} <= set(props)
    assert client.get("/docs").status_code == 404


def test_draining_router_refuses_new_requests():
    app = app_with()
    with TestClient(app) as c:
        app.state.serving.draining = True
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "draining"


def test_decode_reservation_outlives_the_prefill_and_its_transfer():
    """A decode reservation (AdmitRequest.deadline_s) covers the prefill worker's queue and compute
    (bounded by --prefill-timeout-s) and then the transfer (--transfer-deadline-s from its start);
    a sum past what decode workers accept is refused at start-up."""
    from common.errors import ConfigError
    from wire.protocol import MAX_RESERVATION_S

    cfg, _ = parse_args(["--decode", "tcp://127.0.0.1:7200", "--transfer-deadline-s", "20",
                         "--prefill-timeout-s", "300"])
    assert cfg.reservation_s == 320.0
    for bad in (["--transfer-deadline-s", "0"], ["--prefill-timeout-s", str(MAX_RESERVATION_S)]):
        with pytest.raises(ConfigError, match="transfer-deadline-s"):
            parse_args(["--decode", "tcp://127.0.0.1:7200", *bad])
