"""Summary of decode-worker step traces (`--step-trace`, engine/step_trace.py): the figures the results'
NOTES quote about a served run's loop, reproducible from the committed `decode-steps-*.jsonl[.gz]`.

    python -m benchmarks.step_trace_summary benchmarks/results/2026-12-06/launch-hold-ab-1/*/decode-steps-*.jsonl.gz

Per file, after dropping the first fifth (start-up and the first turns' long prefills): steps per second; for
decode-only and mixed steps (any prompt chunk) their count and p50 of host launch, GPU span and blocked wait;
steps collected before the next launch (the host set the pace); and with --launch-hold the launches held,
their p50, and how many mixed steps were launched from a hold (a prompt admitted while the step before ran).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path

SKIP_FRACTION = 0.2


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _p50(vals: list[float]) -> float | None:
    return round(statistics.median(vals), 2) if vals else None


def _col(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def summarize(rows: list[dict], skip: float = SKIP_FRACTION) -> dict:
    # a row's GPU span is the step it collected (the one before it, usually), not its own
    span = {r["collected"]: r["collected_gpu_ms"] for r in rows if r.get("collected_gpu_ms") is not None}
    rows = [r for r in rows if r.get("step")]  # launches (a final collect-only iteration has step 0)
    rows = rows[int(len(rows) * skip):]
    if len(rows) < 2:
        return {"steps": len(rows)}
    out: dict = {"steps": len(rows), "steps_per_s": round((len(rows) - 1) / (rows[-1]["t"] - rows[0]["t"]), 1),
                 "collected_first": sum(bool(r.get("collected_first")) for r in rows)}
    for kind, rs in (("decode", [r for r in rows if not r["chunks"]]), ("mixed", [r for r in rows if r["chunks"]])):
        out[kind] = {"n": len(rs), "tokens_p50": _p50(_col(rs, "tokens")), "launch_ms_p50": _p50(_col(rs, "launch_ms")),
                     "gpu_ms_p50": _p50([span[r["step"]] for r in rs if r["step"] in span]),
                     "wait_ms_p50": _p50(_col(rs, "wait_ms"))}
    held = [r for r in rows if "hold_ms" in r]
    out["held"] = {"n": len(held), "hold_ms_p50": _p50(_col(held, "hold_ms")),
                   "mixed_from_a_hold": sum(1 for r in held if r["chunks"])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_trace_summary", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--skip", type=float, default=SKIP_FRACTION, help="leading share of steps left out")
    a = p.parse_args(argv)
    for path in a.paths:
        print(f"{path}: {json.dumps(summarize(load(path), a.skip))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
