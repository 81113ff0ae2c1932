"""The router's own cost on the streaming path, on CPU: the real router process between a fake decode
worker (real ZMQ, a step loop that hands every running stream one token per step, as the engine does)
and a closed-loop aiohttp client of N concurrent streams.

Issue 25 measured 14-20 ms of router/HTTP in a cached turn's TTFT on the H200 under ~4.3k tokens/s,
growing with the token rate (each decode step hands the router ~60 tokens at once). This isolates that
part. All three processes read one clock (CLOCK_MONOTONIC is host-wide), so per request:

  ingress   client sends the HTTP request -> the worker receives its GenerateRequest
  egress    the worker sends the first token -> the client reads its first SSE event
  ttft      client send -> first event (= ingress + the fake's wait for its next step + egress)

plus the router process's CPU time per generated token (from /proc). The fake worker costs little, so
on the 2-core CPU machine the figures are the router's (and the client's) own.

    python -m benchmarks.router_stream --streams 64 --step-ms 15 --launch-ms 5 --seconds 20 --out /tmp/rs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np

from benchmarks.loadgen import sse_json
from launcher import ports
from wire.protocol import Abort, GenerateRequest, TokenBatch, TokenChunk, WorkerStatus


def _status(running: int) -> WorkerStatus:
    return WorkerStatus(role="decode", worker_id="fake-decode", epoch=1, ready=True, draining=False, queue_depth=0,
                        queued_tokens=0, running=running, kv_free_pages=1 << 20, kv_total_pages=1 << 20,
                        kv_free_sliding_pages=1 << 16, kv_total_sliding_pages=1 << 16, page_size=16,
                        max_num_seqs=4096, busy_seconds=0.0)


def fake_decode_worker(addr: str, step_s: float, launch_s: float, switch_s: float | None, conn) -> None:
    """The decode worker's shape without a model: the real network thread (common/worker_io.py) and a loop
    that, every step_s, "launches" the next step (holding the GIL for launch_s, as Python launching
    kernels does), waits for the step's end without the GIL (as a CUDA event wait), then sends every
    running stream one token. A request's first token comes in the step after it arrived. Sends
    `{rid: (t_recv, t_first_sent)}` through `conn` when told to stop."""
    from common.worker_io import WorkerIO

    io = WorkerIO(addr, lambda req: _status(0))
    io.start()
    if switch_s is not None:
        sys.setswitchinterval(switch_s)  # the A/B of WorkerIO's setting
    running: dict[str, list] = {}  # rid -> [peer, tokens left, first token sent]
    times: dict[str, list[float]] = {}
    next_step = time.monotonic() + step_s
    while not conn.poll():
        for peer, msg, received in io.drain_timed(0.0):
            if isinstance(msg, GenerateRequest):
                running[msg.request_id] = [peer, msg.sampling.max_tokens, False]
                times[msg.request_id] = [received, 0.0]
            elif isinstance(msg, Abort):
                running.pop(msg.request_id, None)
        t_spin = time.perf_counter() + launch_s
        while time.perf_counter() < t_spin:  # the launch: pure Python, the GIL held
            pass
        time.sleep(max(0.0, next_step - time.monotonic()))  # the GPU finishing the step
        by_peer: dict[bytes, list[TokenChunk]] = {}
        first: list[str] = []
        for rid, st in list(running.items()):
            st[1] -= 1
            done = st[1] <= 0
            by_peer.setdefault(st[0], []).append(TokenChunk(rid, [1000 + st[1] % 20000], [], [], done,
                                                            "length" if done else "", ""))
            if not st[2]:
                st[2] = True
                first.append(rid)
            if done:
                del running[rid]
        t_sent = time.monotonic()
        for peer, chunks in by_peer.items():
            io.send(peer, TokenBatch(chunks))
        for rid in first:
            times[rid][1] = t_sent
        next_step += step_s
        if next_step < time.monotonic():  # fell behind: no catch-up burst
            next_step = time.monotonic() + step_s
    conn.recv()
    conn.send(times)
    io.close()


@dataclass
class Sample:
    rid: str = ""
    t_send: float = 0.0
    t_first: float = 0.0
    tokens: int = 0
    error: str = ""


async def one_request(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Sample:
    s = Sample()
    body = {"model": "gpt-oss", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    s.t_send = time.monotonic()
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            s.error = f"http_{resp.status}"
            return s
        async for chunk in sse_json(resp.content):
            ids = (chunk.get("choices") or [{}])[0].get("token_ids") or []
            if ids and not s.t_first:
                s.t_first, s.rid = time.monotonic(), chunk["id"]
            s.tokens += len(ids)
    return s


async def load(url: str, streams: int, seconds: float, prompt_len: int, out_lo: int, out_hi: int,
               seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples: list[Sample] = []
    t_end = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def loop(i: int) -> None:
            await asyncio.sleep(i * 0.01)  # staggered, as conversations are
            while time.monotonic() < t_end:
                prompt = [rng.randrange(1000, 50000) for _ in range(prompt_len)]
                samples.append(await one_request(http, url, prompt, rng.randint(out_lo, out_hi)))

        await asyncio.gather(*(loop(i) for i in range(streams)))
    return samples


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range: a spawned process binds it later


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


@dataclass
class Result:
    streams: int
    step_ms: float
    seconds: float
    requests: int = 0
    errors: int = 0
    tokens_per_s: float = 0.0
    router_cpu_us_per_token: float = 0.0
    client_cpu_us_per_token: float = 0.0
    ttft_ms: dict = field(default_factory=dict)
    ingress_ms: dict = field(default_factory=dict)
    egress_ms: dict = field(default_factory=dict)
    gc_pauses: dict = field(default_factory=dict)  # generation -> collections, total and mean ms during the load
    env: dict = field(default_factory=dict)


def gc_pause_totals(url: str) -> dict[str, tuple[float, float]]:
    """The router's tandem_gc_pause_seconds (common/gc_pauses.py) as generation -> (collections, seconds)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "tandem_gc_pause_seconds":
            continue
        for smp in fam.samples:
            slot = {"tandem_gc_pause_seconds_count": 0, "tandem_gc_pause_seconds_sum": 1}.get(smp.name)
            if slot is not None:
                out.setdefault(smp.labels["generation"], [0.0, 0.0])[slot] = smp.value
    return {g: (c, s) for g, (c, s) in out.items()}


def gc_pause_delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    """generation -> collections, total and mean ms between two gc_pause_totals."""
    out = {}
    for g, (c1, s1) in sorted(after.items()):
        c0, s0 = before.get(g, (0.0, 0.0))
        n, ms = int(c1 - c0), (s1 - s0) * 1e3
        out[g] = {"collections": n, "total_ms": round(ms, 1), "mean_ms": round(ms / max(n, 1), 3)}
    return out


def run(streams: int, step_ms: float, seconds: float, prompt_len: int, out_lo: int, out_hi: int,
        router_loop: str | None, profile: str | None = None, launch_ms: float = 0.0,
        switch_ms: float | None = None) -> Result:
    zport, hport = _free_port(), _free_port()
    zaddr = f"tcp://127.0.0.1:{zport}"
    parent, child = mp.Pipe()
    worker = mp.get_context("spawn").Process(target=fake_decode_worker, args=(zaddr, step_ms / 1e3, launch_ms / 1e3,
                                                                                 None if switch_ms is None else switch_ms / 1e3, child), daemon=True)
    worker.start()
    env = dict(os.environ)
    if router_loop:
        env["TANDEM_ROUTER_LOOP"] = router_loop
    router = subprocess.Popen([sys.executable, "-m", "launcher.cli", "router", "--port", str(hport), "--decode", zaddr,
                               "--colocated", "--max-model-len", "8192"], env=env)
    url = f"http://127.0.0.1:{hport}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                import urllib.request

                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() - t0 > 60 or router.poll() is not None:
                raise RuntimeError("router did not become ready")
            time.sleep(0.2)
        spy = None
        if profile:  # py-spy (pip install py-spy) samples the router for the load's duration
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(router.pid), "--format", "raw", "--rate", "200",
                                    "--duration", str(int(seconds)), "--output", profile, "--nonblocking"])
        gc0 = gc_pause_totals(url)
        cpu0, w0, own0 = _cpu_s(router.pid), time.monotonic(), time.process_time()
        samples = asyncio.run(load(url + "/v1/completions", streams, seconds, prompt_len, out_lo, out_hi, 0))
        cpu1, w1, own1 = _cpu_s(router.pid), time.monotonic(), time.process_time()
        gc1 = gc_pause_totals(url)
        parent.send("stop")
        times = parent.recv()
        if spy is not None:
            spy.wait(60)
    finally:
        router.terminate()
        router.wait(30)
        worker.join(10)
    ok = [s for s in samples if not s.error and s.t_first and s.rid in times]
    toks = sum(s.tokens for s in samples)
    res = Result(streams, step_ms, seconds, requests=len(samples), errors=len(samples) - len(ok),
                 tokens_per_s=toks / (w1 - w0), router_cpu_us_per_token=(cpu1 - cpu0) / max(toks, 1) * 1e6,
                 client_cpu_us_per_token=(own1 - own0) / max(toks, 1) * 1e6,
                 gc_pauses=gc_pause_delta(gc0, gc1),
                 env={"router_loop": router_loop or "default", "prompt_len": prompt_len, "out": [out_lo, out_hi],
                      "launch_ms": launch_ms, "worker_switch_interval_ms": switch_ms or "default"})
    parts = {"ttft_ms": [s.t_first - s.t_send for s in ok],
             "ingress_ms": [times[s.rid][0] - s.t_send for s in ok],
             "egress_ms": [s.t_first - times[s.rid][1] for s in ok]}
    for k, xs in parts.items():
        setattr(res, k, {"p50": round(_pct(xs, 50), 2), "p90": round(_pct(xs, 90), 2), "p99": round(_pct(xs, 99), 2)})
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 64])
    p.add_argument("--step-ms", type=float, default=15.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--out-tokens", type=int, nargs=2, default=[100, 300])
    p.add_argument("--router-loop", default=None, help="TANDEM_ROUTER_LOOP for the router (asyncio | uvloop)")
    p.add_argument("--launch-ms", type=float, default=0.0,
                   help="the fake worker holds the GIL this long per step (a GPU worker's Python launch)")
    p.add_argument("--worker-switch-ms", type=float, default=None,
                   help="the fake worker's GIL switch interval after WorkerIO set its own (A/B; CPython's is 5)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="py-spy raw (collapsed) stacks of the router, last stream count")
    a = p.parse_args(argv)
    rows = []
    for n in a.streams:
        r = run(n, a.step_ms, a.seconds, a.prompt_len, a.out_tokens[0], a.out_tokens[1], a.router_loop,
                a.profile if n == a.streams[-1] else None, a.launch_ms, a.worker_switch_ms)
        rows.append(asdict(r))
        print(f"streams {n:4d}: {r.requests} requests ({r.errors} bad), {r.tokens_per_s:,.0f} tok/s, router "
              f"{r.router_cpu_us_per_token:.0f} us CPU/token (client {r.client_cpu_us_per_token:.0f}) | ttft p50 {r.ttft_ms['p50']:.1f} p90 {r.ttft_ms['p90']:.1f}"
              f" | ingress p50 {r.ingress_ms['p50']:.1f} p90 {r.ingress_ms['p90']:.1f} | egress p50 "
              f"{r.egress_ms['p50']:.1f} p90 {r.egress_ms['p90']:.1f} ms | gc " + ", ".join(
                  f"gen{g} {v['collections']}x {v['mean_ms']:.2f} ms" for g, v in r.gc_pauses.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"router_stream": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
