"""`tandem bench serve` against a real tiny service (router + prefill + decode processes, KV over
NIXL): every request succeeds, the timings are ordered, the token counts are exact; and the
`--launch` path starts `tandem serve` itself, measures, and shuts it down."""

import json

import httpx
import pytest

from launcher.cli import main as tandem
from tests.support.service import start_service


@pytest.fixture(scope="module")
def tiny(ckpt_factory):
    return ckpt_factory("tiny")


@pytest.fixture(scope="module")
def svc(tiny):
    s = start_service(tiny)
    yield s
    s.stop()


def _run(tmp_path, *args):
    out = tmp_path / "serve.json"
    rc = tandem(["bench", "serve", *args, "--out", str(out), "--save-requests", "--request-timeout-s", "60"])
    return rc, json.loads(out.read_text())


def test_completions_open_loop_against_a_running_service(svc, tmp_path):
    rc, doc = _run(tmp_path, "--url", svc.url, "--num-requests", "6", "--request-rate", "8", "--input-len", "16:48",
                   "--output-len", "8", "--seed", "3")
    assert rc == 0
    (run,) = doc["runs"]
    s = run["summary"]
    assert (s["completed"], s["failed"], s["failures"]) == (6, 0, {})
    assert s["output_tokens"] == 6 * 8 and s["output_len_mismatches"] == 0 and s["usage_mismatches"] == 0
    assert 6 * 16 <= s["input_tokens"] <= 6 * 48
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
    assert s["goodput"]["requests_met"] <= 6 and s["request_throughput"] > 0
    for r in run["requests"]:
        assert r["ok"] and r["usage_prompt_tokens"] == r["prompt_tokens"] and 16 <= r["prompt_tokens"] <= 48
        assert 0 < r["ttft_s"] <= r["last_token_s"] <= r["e2e_s"]
        assert len(r["itl_s"]) == 7 and r["usage_completion_tokens"] == r["output_tokens"] == 8
    svc.assert_no_leaks()


def test_chat_at_fixed_concurrency(svc, tmp_path):
    rc, doc = _run(tmp_path, "--url", svc.url, "--api", "chat", "--num-requests", "4", "--max-concurrency", "2",
                   "--input-len", "12", "--output-len", "6")
    s = doc["runs"][0]["summary"]
    assert rc == 0 and s["completed"] == 4 and s["output_tokens"] == 24 and s["output_len_mismatches"] == 0
    # chat prompts are rendered in Harmony: usage counts the framing too
    assert all(r["prompt_tokens"] > 12 for r in doc["runs"][0]["requests"])
    svc.assert_no_leaks()


def test_launch_colocated_runs_and_shuts_down(tiny, tmp_path):
    rc, doc = _run(tmp_path, "--launch", "colocated", "--serve-args", f"--checkpoint {tiny} --kv-cache-gib 0.0625",
                   "--num-requests", "3", "--input-len", "8", "--output-len", "4", "--ready-timeout-s", "120")
    (run,) = doc["runs"]
    assert rc == 0 and run["summary"]["completed"] == 3 and run["summary"]["output_tokens"] == 12
    assert "--colocated" in run["launched"]["command"] and "not model speed" in run["note"]
    log = (tmp_path / "serve-colocated.log").read_text()  # the service's log, kept beside --out
    assert "ready on tcp://" in log and "drained; exiting" in log
    with pytest.raises(httpx.ConnectError):  # the router is gone
        httpx.get(run["url"] + "/health", timeout=5)
