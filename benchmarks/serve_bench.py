"""`tandem bench serve`: open-loop serving benchmark against an OpenAI-compatible endpoint.

Either points at a running server (`--url`), or launches `tandem serve` itself on this machine
(`--launch colocated`, `--launch disaggregated`, or both, one after the other, on the same
resources: disaggregated runs P prefill + D decode workers, colocated runs P + D decode workers
that prefill themselves), waits for /ready, runs the load, and shuts the service down. Reports
TTFT / ITL / TPOT / end-to-end percentiles, request and token throughput, and goodput: requests
per second that met TTFT <= --slo-ttft-ms and mean ITL (TPOT) <= --slo-tpot-ms. JSON to --out,
a short table to stdout.

    tandem bench serve --url http://127.0.0.1:8000 --request-rate 4 --num-requests 200
    tandem bench serve --launch both --request-rate 2 --num-requests 40 --input-len 64:256
    tandem bench serve --multi-turn --launch both --compare-caching --conversations 64 --turns 8

--multi-turn runs conversations instead of independent requests (benchmarks/multi_turn.py);
--compare-caching launches each mode twice, with and without prefix caching.

Overload figures (issue 24): `--burst N` adds N streams sent at once after the run; `--verify-greedy`
replays every completed stream in one process (engine.llm.LLM, same checkpoint and prompt ids) and
counts streams with tokens lost, duplicated or different; the worker status after each run gives
the KV pages left held (launched services, or `--worker ADDR`); responses' x-tandem-queue-wait-s
give the longest wait in the router's admission queue.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import httpx
import numpy as np

from benchmarks import multi_turn
from benchmarks.launched import LaunchedService
from benchmarks.loadgen import LengthRange, LoadSpec, RequestResult, constrained_fraction, plan_requests, run_load
from benchmarks.serve_checks import queue_waits, replay_greedy, settled_status
from common.errors import ConfigError, WorkerUnavailable

CPU_NOTE = ("service launched on the CPU with the embedded tiny model: these numbers measure the load generator "
            "and the serving path (HTTP, router, ZMQ, KV transfer, scheduling), not model speed")
TINY_NOTE = "the server reports a tiny model: these numbers measure the harness and the serving path, not model speed"


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, r: RequestResult) -> bool:
        # A one-token request has no inter-token latency: only its TTFT counts.
        return r.ok and r.ttft_s is not None and r.ttft_s <= self.ttft_s and (r.tpot_s or 0.0) <= self.tpot_s


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """mean and pXX (linear interpolation between order statistics); None on no samples."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in ps}}


def _ms(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (None if v is None else v * 1e3) for k, v in stats.items()}


def summarize(results: list[RequestResult], duration_s: float, slo: SLO) -> dict:
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[r.error_kind or "unknown"] = failures.get(r.error_kind or "unknown", 0) + 1
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = sum(slo.met(r) for r in ok)
    dur = max(duration_s, 1e-9)
    return {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "failures": dict(sorted(failures.items())),
        "first_errors": [f"{r.error_kind}: {r.error}" for r in results if not r.ok][:5],
        "duration_s": duration_s, "input_tokens": n_in, "output_tokens": n_out,
        "request_throughput": len(ok) / dur, "output_token_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
        "ttft_ms": _ms(percentiles([r.ttft_s for r in ok])),
        "itl_ms": _ms(percentiles([x for r in ok for x in r.itl_s])),
        "tpot_ms": _ms(percentiles([r.tpot_s for r in ok if r.tpot_s is not None])),
        "e2e_ms": _ms(percentiles([r.e2e_s for r in ok])),
        "goodput": {"slo_ttft_ms": slo.ttft_s * 1e3, "slo_tpot_ms": slo.tpot_s * 1e3, "requests_met": good,
                    "requests_per_s": good / dur, "fraction": good / len(results)},
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_tokens for r in ok),
        # usage (when the server sends it) must agree with what we sent and counted
        "usage_mismatches": sum((r.usage_completion_tokens is not None and r.usage_completion_tokens != r.output_tokens)
                                or (r.usage_prompt_tokens is not None and r.usage_prompt_tokens != r.prompt_tokens)
                                for r in ok),
        "max_dispatch_lag_ms": max((r.dispatch_s - r.scheduled_s for r in results), default=0.0) * 1e3,
    }


def format_table(run: dict) -> str:
    s = run["summary"]
    head = f"{run['label']}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.2f} s"
    if s["failed"]:
        head += f"  failures {s['failures']}"
    lines = [head, f"{'metric':10} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        vals = [s[key][k] for k in ("mean", "p50", "p90", "p99")]
        lines.append(f"{key:10} " + " ".join(f"{v:9.1f}" if v is not None else f"{'-':>9}" for v in vals))
    g = s["goodput"]
    lines.append(f"throughput {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
                 f"{s['total_token_throughput']:.1f} total tok/s; goodput {g['requests_per_s']:.2f} req/s "
                 f"({g['requests_met']}/{s['num_requests']} met TTFT<={g['slo_ttft_ms']:g} ms, "
                 f"TPOT<={g['slo_tpot_ms']:g} ms)")
    q = s.get("queue_wait") or {}
    if q.get("max_s") is not None:
        lines.append(f"router queue wait: max {q['max_s']:.2f} s, p50 {q['p50_s']:.2f} s, p99 {q['p99_s']:.2f} s")
    if "pages_held_after" in s:
        lines.append(f"KV pages still held after the run: {s['pages_held_after']}")
    if "replay" in s:
        rp = s["replay"]
        lines.append(f"greedy replay: {rp['equal']}/{rp['streams']} equal, {rp['lost']} lost, {rp['duplicated']} "
                     f"duplicated, {rp['different']} different ({rp['tokens_lost']} tokens lost, "
                     f"{rp['tokens_duplicated']} duplicated)")
    if run.get("note"):
        lines.append(f"note: {run['note']}")
    return "\n".join(lines)


def format_comparison(runs: list[dict]) -> str:
    cols = [("completed", "completed", "{:.0f}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_token_throughput", "{:.1f}"), ("goodput", ("goodput", "requests_per_s"), "{:.2f}"),
            ("TTFT p50", ("ttft_ms", "p50"), "{:.1f}"), ("TTFT p99", ("ttft_ms", "p99"), "{:.1f}"),
            ("TPOT p50", ("tpot_ms", "p50"), "{:.1f}"), ("TPOT p99", ("tpot_ms", "p99"), "{:.1f}")]
    lines = [f"{'':14}" + "".join(f"{c:>11}" for c, _, _ in cols)]
    for run in runs:
        cells = []
        for _, key, fmt in cols:
            v = run["summary"][key] if isinstance(key, str) else run["summary"][key[0]][key[1]]
            cells.append(f"{fmt.format(v) if v is not None else '-':>11}")
        lines.append(f"{run['label']:14}" + "".join(cells))
    return "\n".join(lines)


# ---- launching `tandem serve` ----------------------------------------------------------------------
def _model_of(url: str, timeout_s: float) -> str:
    try:
        r = httpx.get(url + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise WorkerUnavailable(f"could not read the model name from {url}/v1/models ({e}); pass --model") from None


def run_one(label: str, url: str, a: argparse.Namespace, note: str | None, workers: list[str] | None = None,
            checkpoint: str | None = None) -> list[dict]:
    runs = [_measure(label, url, a, note, workers, checkpoint)]
    if a.burst:
        burst = argparse.Namespace(**{**vars(a), "num_requests": a.burst, "request_rate": math.inf,
                                      "max_concurrency": None, "warmup": 0, "seed": a.seed + 7})
        runs.append(_measure(f"{label} burst {a.burst}", url, burst, note, workers, checkpoint))
    return runs


def _measure(label: str, url: str, a: argparse.Namespace, note: str | None, workers: list[str] | None,
             checkpoint: str | None) -> dict:
    spec = LoadSpec(base_url=url, model=a.model or _model_of(url, a.connect_timeout_s), api=a.api,
                    num_requests=a.num_requests, request_rate=a.request_rate, burstiness=a.burstiness,
                    max_concurrency=a.max_concurrency, input_len=LengthRange.parse(a.input_len),
                    output_len=LengthRange.parse(a.output_len), seed=a.seed, extras=not a.no_extras,
                    request_timeout_s=a.request_timeout_s, connect_timeout_s=a.connect_timeout_s,
                    json_schema=a.json_schema, temperature=a.temperature)
    if a.warmup:
        warm = replace(spec, num_requests=a.warmup, request_rate=math.inf, seed=spec.seed + 1)
        bad = [r for r in asyncio.run(run_load(warm, plan_requests(warm))).results if not r.ok]
        if bad:
            print(f"warm-up: {len(bad)}/{a.warmup} failed, first: {bad[0].error_kind}: {bad[0].error}", flush=True)
    planned = plan_requests(spec)
    out = asyncio.run(run_load(spec, planned))
    load = asdict(spec)
    load["request_rate"] = None if math.isinf(spec.request_rate) else spec.request_rate  # JSON has no inf
    run = {"label": label, "url": url, "note": note, "load": load,
           "summary": summarize(out.results, out.duration_s, SLO(a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3))}
    run["summary"]["queue_wait"] = queue_waits(out.results)
    if a.json_schema:
        run["summary"]["constrained_fraction"] = constrained_fraction(out.results)
    if workers:
        run["workers_after"] = settled_status(workers)
        run["summary"]["pages_held_after"] = sum(w.get("pages_held", 0) + w.get("sliding_pages_held", 0)
                                                 for w in run["workers_after"])
    if a.verify_greedy:
        if spec.api != "completions" or not checkpoint or spec.temperature:
            raise ConfigError("--verify-greedy needs --api completions (token-id prompts), a checkpoint and "
                              "--temperature 0")
        run["summary"]["replay"] = replay_greedy(checkpoint, planned, out.results)
    if a.save_requests:
        run["requests"] = [{**{f.name: getattr(r, f.name) for f in fields(r)}, "tpot_s": r.tpot_s} for r in out.results]
    return run


def _serve_checkpoint(serve_args: list[str]) -> str:
    if "--checkpoint" in serve_args:
        return serve_args[serve_args.index("--checkpoint") + 1]
    from launcher.cmd_serve import DEFAULT_CACHE
    from model.checkpoint_io import ensure_checkpoint

    return str(ensure_checkpoint("tiny", DEFAULT_CACHE))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    t = p.add_mutually_exclusive_group(required=True)
    t.add_argument("--url", help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    t.add_argument("--launch", choices=["colocated", "disaggregated", "both"], help="start `tandem serve` here")
    p.add_argument("--model", default=None, help="default: the first id of /v1/models")
    p.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="completions sends token-id prompts; chat sends words (about one token each)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals (default: inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests")
    p.add_argument("--input-len", default="128", help="N or LO:HI (uniform)")
    p.add_argument("--output-len", default="64", help="N or LO:HI (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-extras", action="store_true", help="do not send ignore_eos / return_token_ids")
    p.add_argument("--json-schema", action="store_true",
                   help="structured outputs: every request carries a json_schema response_format (loadgen."
                        "GRAMMAR_SCHEMA) and, with --api completions, a prompt ending in the Harmony final "
                        "header, so each output token is grammar-constrained; compare ITL/TPOT with a run without")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy; the OpenAI default is 1)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent (all at once) before the measured run; "
                   "--multi-turn: conversations of two turns (another seed) before each measured load")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--connect-timeout-s", type=float, default=10.0)
    p.add_argument("--num-prefill", type=int, default=1, help="--launch: prefill workers (disaggregated)")
    p.add_argument("--num-decode", type=int, default=1, help="--launch: decode workers (disaggregated)")
    p.add_argument("--colocated-decode", type=int, default=None,
                   help="--launch colocated: decode workers (default: --num-prefill + --num-decode, the same number "
                        "of workers as disaggregated; 1 is how vLLM or SGLang would run on one GPU)")
    p.add_argument("--serve-args", default="", help="--launch: extra flags for tandem serve, one string")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument("--save-requests", action="store_true", help="keep every request's timings in the JSON")
    p.add_argument("--burst", type=int, default=0, help="after the run: N more streams, all sent at once")
    p.add_argument("--verify-greedy", action="store_true",
                   help="replay every completed stream in one process (engine.llm.LLM) and count streams with "
                        "lost, duplicated or different tokens (completions API, greedy)")
    p.add_argument("--checkpoint", default=None, help="--verify-greedy: the checkpoint the server runs "
                   "(default with --launch: --serve-args' --checkpoint, else the embedded tiny model)")
    p.add_argument("--worker", action="append", default=[],
                   help="--url: a worker tcp://HOST:PORT whose KV pages are checked after each run (repeat)")
    m = p.add_argument_group("multi-turn (--multi-turn): conversations that resend their history each turn")
    m.add_argument("--multi-turn", action="store_true")
    m.add_argument("--conversations", type=int, default=64)
    m.add_argument("--turns", type=int, default=8)
    m.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    m.add_argument("--user-len", default="100:300", help="new user tokens per turn: N or LO:HI")
    m.add_argument("--conversation-gap-ms", type=float, default=0.0, help="stagger the conversations' starts")
    m.add_argument("--client-procs", type=int, default=1,
                   help="load client processes, the conversations dealt round-robin (one event loop parsing every "
                        "stream's events adds its own delay to each TTFT it measures)")
    m.add_argument("--compare-caching", action="store_true",
                   help="--launch: each mode with --enable-prefix-caching and with --no-enable-prefix-caching "
                        "(disaggregated also with --remote-prefill-min-tokens 0: every prefill remote)")
    return p


def _workers(mode: str, a: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) counts for LaunchedService (colocated runs their sum as decode workers)."""
    if mode == "colocated" and a.colocated_decode is not None:
        return 0, a.colocated_decode
    return a.num_prefill, a.num_decode


def _kept_log(a: argparse.Namespace, label: str) -> Path | None:
    """Beside --out: the launched service's log, one per launch (`serve_x.json` -> `serve_x-colocated-cache-on.log`)."""
    if not a.out:
        return None
    out = Path(a.out)
    return out.with_name(f"{out.stem}-{'-'.join(label.replace(',', ' ').split())}.log")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    if a.num_prefill < 1 or a.num_decode < 1 or (a.colocated_decode is not None and a.colocated_decode < 1):
        raise ConfigError("--num-prefill, --num-decode and --colocated-decode must be >= 1")
    if a.multi_turn:
        return main_multi_turn(a, sys.argv[1:] if argv is None else argv)
    runs = []
    if a.url:
        url = a.url.rstrip("/")
        tiny = "tiny" in (a.model or _model_of(url, a.connect_timeout_s))
        runs += run_one(url, url, a, TINY_NOTE if tiny else None, a.worker, a.checkpoint)
    else:
        serve_args = shlex.split(a.serve_args)
        note = None if "cuda" in a.serve_args else CPU_NOTE
        checkpoint = a.checkpoint or _serve_checkpoint(serve_args) if a.verify_greedy else None
        for mode in (["disaggregated", "colocated"] if a.launch == "both" else [a.launch]):
            with LaunchedService(mode, *_workers(mode, a), serve_args, a.ready_timeout_s,
                                 _kept_log(a, mode)) as svc:
                for run in run_one(mode, svc.url, a, note, svc.workers, checkpoint):
                    run["launched"] = {"mode": mode, "command": svc.cmd[2:]}
                    runs.append(run)
    doc = {"kind": "tandem-bench-serve", "version": 1,
           "env": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                   "cpus": os.cpu_count(), "python": platform.python_version()},
           "runs": runs}
    for run in runs:
        print(format_table(run), flush=True)
    if len(runs) > 1:
        print(format_comparison(runs), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.out}")
    bad_replay = any(r["summary"].get("replay", {}).get("equal", 0) != r["summary"].get("replay", {}).get(
        "streams", 0) for r in runs)
    return 1 if any(r["summary"]["failed"] for r in runs) or bad_replay else 0



def main_multi_turn(a: argparse.Namespace, argv: list[str]) -> int:
    def spec(url: str) -> multi_turn.MultiTurnSpec:
        return multi_turn.MultiTurnSpec(url, a.model or _model_of(url, a.connect_timeout_s), a.conversations,
                                        a.turns, a.system_len, LengthRange.parse(a.user_len),
                                        LengthRange.parse(a.output_len), a.conversation_gap_ms / 1e3, a.seed,
                                        request_timeout_s=a.request_timeout_s, client_procs=a.client_procs)

    runs = []
    if a.url:
        runs.append(multi_turn.run(spec(a.url.rstrip("/")), a.url, warmup=a.warmup))
    else:
        base_args = shlex.split(a.serve_args)
        for mode in (["colocated", "disaggregated"] if a.launch == "both" else [a.launch]):
            variants = [("", [])]
            if a.compare_caching:  # disaggregated also with every prefill remote: what shipping only new pages gives
                variants = [("cache on", ["--enable-prefix-caching"])] + (
                    [("cache on, remote", ["--enable-prefix-caching", "--remote-prefill-min-tokens", "0"])]
                    if mode == "disaggregated" else []) + [("cache off", ["--no-enable-prefix-caching"])]
            for name, flags in variants:
                label = f"{mode} {name}".strip()
                with LaunchedService(mode, *_workers(mode, a), base_args + flags, a.ready_timeout_s,
                                     _kept_log(a, label)) as svc:
                    run = multi_turn.run(spec(svc.url), label, svc.workers, warmup=a.warmup)
                    run["launched"] = {"mode": mode, "command": svc.cmd[2:]}
                    if "cuda" not in a.serve_args:
                        run["note"] = CPU_NOTE
                    runs.append(run)
                print(multi_turn.format_runs(runs[-1:]), flush=True)
    doc = {"kind": "tandem-bench-serve-multi-turn", "version": 1,
           "env": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
                   "cpus": os.cpu_count(), "python": platform.python_version()},
           "command": "tandem bench serve " + shlex.join(argv), "args": vars(a),
           "runs": runs}
    print(multi_turn.format_runs(runs), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.out}")
    return 1 if any(r["summary"]["failed"] or (r.get("leaks") or {}).get("leaked") for r in runs) else 0
