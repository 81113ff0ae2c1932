"""Disaggregated serving on GPUs without the HTTP layer: a prefill worker and a decode worker as real
processes (e.g. GPU 0 and GPU 1, KV over NIXL VRAM -> VRAM), driven through the router's wire protocol.

For each prompt the same request runs twice: colocated on the decode worker (GenerateRequest) and
disaggregated (AdmitRequest -> PrefillRequest -> StartDecode). Greedy tokens must be identical;
TTFT, transfer GB/s and decode ms/token are reported. Then a burst of concurrent disaggregated
requests checks batching and that every KV page comes back.

    python -m benchmarks.disagg_smoke --prefill tcp://127.0.0.1:7100 --decode tcp://127.0.0.1:7200
"""

from __future__ import annotations

import argparse
import json
import os
import time

import zmq

from benchmarks.common import environment
from wire.protocol import (AdmitRequest, Admitted, GenerateRequest, PrefillRequest, PrefillResult, SamplingSpec,
                             StartDecode, StatusRequest, TokenBatch, TokenChunk, WorkerStatus, decode, encode)


class Peer:
    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.queued: list[TokenChunk] = []

    def send(self, msg) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float = 60.0) -> object:
        """The next message; a decode step's TokenBatch is handed out one TokenChunk at a time."""
        if self.queued:
            return self.queued.pop(0)
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply")
        msg = decode(self.sock.recv())
        if isinstance(msg, TokenBatch):
            self.queued = list(msg.chunks[1:])
            return msg.chunks[0]
        return msg


def wait_ready(p: Peer, timeout_s: float) -> WorkerStatus:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        p.send(StatusRequest())
        try:
            st = p.recv(2.0)
            if isinstance(st, WorkerStatus) and st.ready:
                while p.sock.poll(500):  # late answers to earlier polls
                    p.sock.recv()
                return st
        except TimeoutError:
            pass
        time.sleep(1.0)
    raise TimeoutError("worker not ready")


def collect(d: Peer, rids: set[str], timeout_s: float = 300) -> dict[str, tuple[list[int], list[float]]]:
    """Tokens and arrival times per request until every one finished."""
    out = {r: ([], []) for r in rids}
    done: set[str] = set()
    while done != rids:
        m = d.recv(timeout_s)
        if isinstance(m, TokenChunk) and m.request_id in out:
            if m.error:
                raise RuntimeError(f"{m.request_id}: {m.error}")
            out[m.request_id][0].extend(m.token_ids)
            out[m.request_id][1].extend([time.monotonic()] * len(m.token_ids))
            if m.finished:
                done.add(m.request_id)
    return out


def disagg(p: Peer, d: Peer, rid: str, prompt: list[int], spec: SamplingSpec) -> tuple[list[int], dict]:
    t0 = time.monotonic()
    d.send(AdmitRequest(rid, len(prompt), spec.max_tokens, 1, 120.0))
    adm = d.recv(60)
    assert isinstance(adm, Admitted), adm
    p.send(PrefillRequest(rid, prompt, spec, adm.kv_target, 120.0))
    res = p.recv(300)
    assert isinstance(res, PrefillResult) and res.ok, res
    ttft = time.monotonic() - t0
    d.send(StartDecode(rid, prompt, spec, res.first_token, res.first_logprob, res.first_top))
    toks, times = collect(d, {rid})[rid]
    itl = (times[-1] - times[0]) / max(len(times) - 1, 1) if len(times) > 1 else 0.0
    return [res.first_token] + toks, {"ttft_s": ttft, "prefill_s": res.prefill_seconds,
                                      "transfer_GBps": res.transfer_bytes / max(res.transfer_seconds, 1e-9) / 1e9,
                                      "transfer_MB": res.transfer_bytes / 1e6, "itl_ms": itl * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="tcp://127.0.0.1:7100")
    ap.add_argument("--decode", default="tcp://127.0.0.1:7200")
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "disagg_smoke.json"))
    a = ap.parse_args()
    p, d = Peer(a.prefill), Peer(a.decode)
    wait_ready(p, 600)
    st0 = wait_ready(d, 600)
    spec = SamplingSpec(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for n in [int(x) for x in a.lengths.split(",")]:
        prompt = [(i * 7919 + n) % 200000 for i in range(n)]
        d.send(GenerateRequest(f"colo-{n}", prompt, spec))
        colo = collect(d, {f"colo-{n}"})[f"colo-{n}"][0]
        dis, stats = disagg(p, d, f"dis-{n}", prompt, spec)
        agree = next((i for i, (a, b) in enumerate(zip(dis, colo)) if a != b), min(len(dis), len(colo)))
        rows.append({"prompt_tokens": n, "identical": dis == colo, "agree_prefix": agree, "tokens": len(colo), **stats})
        print(f"prompt {n:>6}: identical={dis == colo} (first {agree}/{len(colo)} agree)  TTFT {stats['ttft_s'] * 1e3:.1f} ms (prefill "
              f"{stats['prefill_s'] * 1e3:.1f} ms, KV {stats['transfer_MB']:.1f} MB at {stats['transfer_GBps']:.1f} "
              f"GB/s)  decode {stats['itl_ms']:.2f} ms/token", flush=True)
    # A burst: admissions first, prefills queue on the (batch-1) prefill worker, decodes batch together.
    prompts = {f"burst-{i}": [(i * 31 + j * 17) % 200000 for j in range(1024 + 64 * i)] for i in range(a.burst)}
    t0 = time.monotonic()
    firsts = {}
    for rid, prompt in prompts.items():
        d.send(AdmitRequest(rid, len(prompt), spec.max_tokens, 1, 120.0))
        adm = d.recv(60)
        p.send(PrefillRequest(rid, prompt, spec, adm.kv_target, 120.0))
    for _ in prompts:
        res = p.recv(300)
        assert res.ok, res
        firsts[res.request_id] = res
        d.send(StartDecode(res.request_id, prompts[res.request_id], spec, res.first_token, res.first_logprob,
                           res.first_top))
    outs = collect(d, set(prompts))
    burst_s = time.monotonic() - t0
    assert all(len(t) == a.max_tokens - 1 for t, _ in outs.values())
    time.sleep(1.0)
    d.send(StatusRequest())
    st = d.recv(5)
    leak_free = st.kv_free_pages == st0.kv_free_pages and st.kv_free_sliding_pages == st0.kv_free_sliding_pages
    summary = {"env": environment(), "config": vars(a), "rows": rows, "burst": {"requests": a.burst, "seconds": burst_s,
                                       "tokens_per_s": a.burst * a.max_tokens / burst_s},
               "decode_pages_all_returned": leak_free, "all_identical": all(r["identical"] for r in rows)}
    print(json.dumps(summary["burst"]), "pages returned:", leak_free, "all identical:", summary["all_identical"])
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
