"""The whole stack served on ONE GPU, colocated and disaggregated side by side, against the engine's
own figures from the same run (`benchmarks.bench_model`'s JSON).

For each mode (`tandem serve` launched with full-size random weights; disaggregated = a prefill and
a decode process sharing the GPU, KV over `--kv-backend ipc`):
  single     one stream at a time (max concurrency 1): its mean ITL against the graph replay of
             batch 1 at the nearest context bench_model measured
  sweep      open-loop Poisson at each --rates value with --input-len / --output-len ranges:
             TTFT / ITL / TPOT p50 / p99, output tok/s, goodput under the SLO
  saturation a closed loop of --sat-batch streams (fixed lengths): served output tok/s while all
             of them decode (the steady window), against bench_model's tok/s at that batch and the
             nearest context; the whole run's tok/s (prefill and ramps included) beside it
The JSON is a `tandem bench serve` document (kind tandem-bench-serve) with a "reference" block.

    python -m benchmarks.serve_gpu --model-json OUT/model_gpt-oss-20b-tp1.json --out OUT/serve_gpu.json \
        --serve-args "--device cuda --fp8 --random-weights gpt-oss-20b ..."
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import subprocess
import time
from pathlib import Path

from benchmarks.launched import LaunchedService
from benchmarks.serve_bench import build_parser, format_comparison, format_table, run_one


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def nearest(rows: list[dict], batch: int, context: int) -> dict | None:
    """bench_model's decode row of this batch with the nearest context (None if absent)."""
    cands = [r for r in rows if r.get("batch") == batch and "skipped" not in r]
    return min(cands, key=lambda r: abs(r["context"] - context)) if cands else None


def steady_state(requests: list[dict]) -> dict | None:
    """Output tokens per second while every stream of a closed loop decodes: from the last first
    token to the first last token (no prefill, no ramp). Each token's time is rebuilt from the
    request's dispatch, TTFT and inter-token gaps."""
    ok = [q for q in requests if q["ok"] and q["ttft_s"] is not None]
    if len(ok) < 2:
        return None
    times = []
    for q in ok:
        t = q["dispatch_s"] + q["ttft_s"]
        ts = [t]
        for gap in q["itl_s"]:
            t += gap
            ts.append(t)
        times.append(ts)
    start, end = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    if end - start < 1.0:
        return None
    n = sum(1 for ts in times for t in ts if start < t <= end)
    return {"window_s": end - start, "tokens": n, "output_tok_s": n / (end - start), "streams": len(ok)}


def load_args(a: argparse.Namespace, **kw) -> argparse.Namespace:
    """serve_bench's own arguments for one load run."""
    base = ["--url", "http://unused", "--api", "completions", "--seed", str(a.seed), "--slo-ttft-ms",
            str(a.slo_ttft_ms), "--slo-tpot-ms", str(a.slo_tpot_ms), "--request-timeout-s", str(a.request_timeout_s),
            "--temperature", str(getattr(a, "temperature", 0.0))]
    ns = build_parser().parse_args(base)
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def run_mode(mode: str, a: argparse.Namespace, ref: dict) -> list[dict]:
    runs = []
    # colocated: ONE decode worker prefills and decodes (as vLLM or SGLang on one GPU); disaggregated:
    # a prefill and a decode worker sharing the GPU
    with LaunchedService(mode, 0 if mode == "colocated" else 1, 1, shlex.split(a.serve_args),
                         a.ready_timeout_s) as svc:
        model = None
        if a.warmup:
            # every prompt shape the sweep will bring (chunked prefill included), so no first-time
            # compile or autotune lands inside a measured run
            run_one("warmup", svc.url, load_args(a, num_requests=a.warmup, input_len=a.input_len, output_len="16",
                                                 max_concurrency=None, request_rate=math.inf, model=model), None)
        single_in = max(1, a.single_context - a.single_output // 2)
        r = run_one(f"{mode} single", svc.url, load_args(
            a, num_requests=a.single_requests, input_len=str(single_in), output_len=str(a.single_output),
            max_concurrency=1, request_rate=math.inf, model=model), None)
        r["kind"] = "single"
        row = nearest(ref.get("decode", {}).get("rows", []), 1, a.single_context)
        if row and row.get("gpu_ms_graph_replay"):
            itl = r["summary"]["tpot_ms"]["mean"]
            r["vs_engine"] = {"replay_ms_batch1": row["gpu_ms_graph_replay"], "context": row["context"],
                              "engine_ms_per_step": row.get("ms_per_step"),
                              "itl_over_replay": itl / row["gpu_ms_graph_replay"] if itl else None}
        runs.append(r)
        for rate in a.rates:
            r = run_one(f"{mode} @{rate:g}/s", svc.url, load_args(
                a, num_requests=a.num_requests, input_len=a.input_len, output_len=a.output_len,
                max_concurrency=None, request_rate=rate, model=model), None)
            r["kind"] = "sweep"
            runs.append(r)
        sat_in = max(1, a.sat_context - a.sat_output // 2)
        r = run_one(f"{mode} sat{a.sat_batch}", svc.url, load_args(
            a, num_requests=a.sat_batch * a.sat_rounds, input_len=str(sat_in), output_len=str(a.sat_output),
            max_concurrency=a.sat_batch, request_rate=math.inf, model=model, save_requests=True), None)
        r["kind"] = "saturation"
        r["steady"] = steady_state(r.pop("requests"))
        row = nearest(ref.get("decode", {}).get("rows", []), a.sat_batch, a.sat_context)
        if row and r["steady"]:
            tps = r["steady"]["output_tok_s"]
            r["vs_engine"] = {"engine_tok_s": row["tok_s_per_gpu"], "context": row["context"], "batch": a.sat_batch,
                              "served_steady_tok_s": tps, "served_over_engine": tps / row["tok_s_per_gpu"],
                              "whole_run_tok_s": r["summary"]["output_token_throughput"]}
        runs.append(r)
        for run in runs:
            run["launched"] = {"mode": mode, "command": svc.cmd[2:]}
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-json", required=True, help="bench_model's JSON of the same run (the reference)")
    p.add_argument("--serve-args", required=True, help="flags for tandem serve (device, weights, KV budgets)")
    p.add_argument("--modes", default="colocated,disaggregated")
    p.add_argument("--rates", default="0.5,1,2,4", help="request rates of the sweep, req/s")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--input-len", default="1024:8192")
    p.add_argument("--output-len", default="256:1024")
    p.add_argument("--single-context", type=int, default=2048)
    p.add_argument("--single-output", type=int, default=512)
    p.add_argument("--single-requests", type=int, default=2)
    p.add_argument("--sat-batch", type=int, default=64)
    p.add_argument("--sat-context", type=int, default=2048)
    p.add_argument("--sat-output", type=int, default=1536)
    p.add_argument("--sat-rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy, as bench_model)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    a.rates = [float(x) for x in a.rates.split(",") if x]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    ref = json.loads(Path(a.model_json).read_text())
    runs = []
    for mode in [m for m in a.modes.split(",") if m]:
        runs += run_mode(mode, a, ref)
        Path(a.out).write_text(json.dumps(_doc(runs, a, ref), indent=1))  # each mode saved as it finishes
    for run in runs:
        print(format_table(run), flush=True)
    print(format_comparison(runs), flush=True)
    for run in runs:
        if "vs_engine" in run:
            print(f"{run['label']}: {json.dumps(run['vs_engine'])}", flush=True)
    return 1 if any(r["summary"]["failed"] for r in runs) else 0


def _doc(runs: list[dict], a: argparse.Namespace, ref: dict) -> dict:
    return {"kind": "tandem-bench-serve", "version": 1, "suite": "served-h200",
            "env": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": gpu_name(),
                    "engine_env": ref.get("env")},
            "args": {k: v for k, v in vars(a).items()},
            "reference": {"model_json": a.model_json, "decode": ref.get("decode", {}).get("rows", [])},
            "runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())
