"""Markdown helpers shared by the results report (benchmarks/report.py) and its targets
(benchmarks/report_targets.py)."""

from __future__ import annotations


def fmt(v: object) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "–"}[v]
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def table(rows: list[list[object]], head: list[str]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows], ""]


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def last_line(err: str) -> str:
    lines = [ln.strip() for ln in err.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else err
