"""Structured outputs' cost per token on the served stack: ONE launched service, the same closed loop
of --batch streams run without and then with a json_schema response_format on every request
(`tandem bench serve --json-schema`: benchmarks/loadgen.GRAMMAR_SCHEMA, completions prompts ending
in the Harmony final header, so the grammar acts on every output token), then without again (the
drift of the machine between runs). Reports TPOT / ITL percentiles and the steady-state output
tok/s of each run (benchmarks/serve_gpu.steady_state), and the json / free ratios.

What it measures: the host's mask work (llguidance, all constrained rows of a step in parallel, while
the step's forward runs: engine/runner.py) and the device's bitmask application, as the served stack
sees them, including the deferred-sampling wait when the masks take longer than a forward.

    python -m benchmarks.grammar_bench --serve-args "--device cuda --fp8 --random-weights gpt-oss-20b ..." \
        --batch 64 --input-len 1024 --output-len 256 --out OUT/grammar.json
    python -m benchmarks.grammar_bench --batch 8 --input-len 32 --output-len 48 --out /tmp/g.json   # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import time
from pathlib import Path

from benchmarks.launched import LaunchedService
from benchmarks.serve_bench import format_table, run_one
from benchmarks.serve_gpu import gpu_name, load_args, steady_state


def measure(url: str, a: argparse.Namespace, label: str, json_schema: bool) -> dict:
    r = run_one(label, url, load_args(a, num_requests=a.batch * a.rounds, input_len=str(a.input_len),
                                      output_len=str(a.output_len), max_concurrency=a.batch, request_rate=math.inf,
                                      json_schema=json_schema, save_requests=True, model=None), None)[0]
    r["steady"] = steady_state(r.pop("requests"))
    return r


def ratios(free: dict, js: dict) -> dict:
    def get(run: dict, *path):
        x = run
        for k in path:
            x = (x or {}).get(k)
        return x

    out = {}
    for name, path in (("tpot_p50", ("summary", "tpot_ms", "p50")), ("tpot_mean", ("summary", "tpot_ms", "mean")),
                       ("itl_p99", ("summary", "itl_ms", "p99")), ("steady_tok_s", ("steady", "output_tok_s"))):
        f, j = get(free, *path), get(js, *path)
        out[name] = {"free": f, "json_schema": j, "json_over_free": (j / f) if f and j else None}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="flags for tandem serve (default: the CPU tiny model)")
    p.add_argument("--mode", choices=["colocated", "disaggregated"], default="colocated")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="requests = batch x rounds")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    runs = []
    with LaunchedService(a.mode, 0 if a.mode == "colocated" else 1, 1, shlex.split(a.serve_args),
                         a.ready_timeout_s) as svc:
        if a.warmup:  # both paths once (CUDA graphs, the grammar tokenizer, FlashInfer plans) before measuring
            for js in (False, True):
                run_one("warmup", svc.url, load_args(a, num_requests=a.warmup, input_len=str(a.input_len),
                                                     output_len="16", max_concurrency=None, request_rate=math.inf,
                                                     json_schema=js, model=None), None)
                svc.check_alive(f"the warm-up (json_schema={js})")  # grammar-gpu run 1 died there
        for label, js in (("free", False), ("json_schema", True), ("free again", False)):
            run = measure(svc.url, a, label, js)
            svc.check_alive(f"the {label} run")
            run["launched"] = {"mode": a.mode, "command": svc.cmd[2:]}
            runs.append(run)
            print(format_table(run), flush=True)
    doc = {"kind": "tandem-bench-serve", "version": 1, "suite": "grammar",
           "env": {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": gpu_name()},
           "args": vars(a), "runs": runs, "grammar_cost": ratios(runs[0], runs[1]),
           "drift": ratios(runs[0], runs[2])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    for name, v in doc["grammar_cost"].items():
        print(f"grammar {name}: free {v['free']} json {v['json_schema']} ratio {v['json_over_free']}", flush=True)
    print(f"wrote {a.out}", flush=True)
    return 1 if any(r["summary"]["failed"] for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
