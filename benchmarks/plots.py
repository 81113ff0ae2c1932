"""PNG plots of the model benchmarks, shaped like the seed's ("gpt-oss on day 0"): cost against
speed, one series per model / parallelism, each point labelled with its input length or batch.

  prefill.png             batch-1 prefill: latency (ms) vs $/M input tokens, by input length
  decode_ctx<N>.png       decode at context N: tokens/s per user vs $/M output tokens (left) and vs
                          tokens/s per GPU (right), over batch sizes

Input is the list of `ModelSeries` report.py builds from the committed JSON: one line per
configuration, its newest run, whose run and date the legend names. Nothing is computed here beyond
what is drawn. The PNGs carry matplotlib's version and no timestamp, so re-running on the same JSON
with the same matplotlib gives the same bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import ConfigError


@dataclass(slots=True)
class ModelSeries:
    """One model / parallelism configuration: for prefill and for each decode context, the rows of one
    run (the newest that measured it; report.build_series), never several runs on one line."""

    label: str  # "gpt-oss-20b TP1"
    gpus: int
    prefill: list[dict] = field(default_factory=list)  # bench_model prefill rows
    decode: list[dict] = field(default_factory=list)  # bench_model decode rows (no skipped ones)
    sources: dict[str | int, str] = field(default_factory=dict)  # "prefill" / context -> "run DG10, 2026-12-02"
    # (context, batch) -> (row, source): the newest run that measured that one point, for the README's summary
    # cells (a newer run of fewer batch sizes must not blank a cell an older run measured)
    points: dict[tuple[int, int], tuple[dict, str]] = field(default_factory=dict)
    card: str = ""  # the GPU when not an H200 (report_series.card_of; also the label's last part)

    def legend(self, key: str | int) -> str:
        gpus = f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
        return f"{self.label} ({gpus}; {self.sources[key]})" if key in self.sources else f"{self.label} ({gpus})"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib (pip install matplotlib), or pass --no-plots") from None
    matplotlib.use("Agg")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # the CLI logs INFO; font-cache chatter
    import matplotlib.pyplot as plt

    return plt


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    import matplotlib  # the version, not a timestamp: the same JSON and matplotlib give the same bytes

    fig.savefig(path, dpi=120, bbox_inches="tight", metadata={"Software": f"matplotlib {matplotlib.__version__}"})


def prefill_plot(series: list[ModelSeries], path: Path, price: float) -> Path | None:
    plt = _pyplot()
    rows = [s for s in series if s.prefill]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for i, s in enumerate(rows):
        pts = sorted(s.prefill, key=lambda r: r["tokens"])
        xs, ys = [r["ms"] for r in pts], [r["usd_per_M_input"] for r in pts]
        ax.plot(xs, ys, "o-", label=s.legend("prefill"))
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(_short(r["tokens"]), (x, y), textcoords="offset points", xytext=(4, 4 if i % 2 else -11),
                        fontsize=8)  # alternate above/below so close series keep readable labels
    ax.set_xscale("log")
    ax.set_xlabel("prefill latency, batch 1 (ms, log)")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}" if str(v)[0] in "25" else ""))
    ax.set_ylabel(f"\\$ per M input tokens (at \\${price:.2f}/GPU-hour)")  # escaped: $ starts mathtext
    ax.set_title("Prefill: latency vs cost by input length (H200, FP8)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=9)  # below: no point hidden
    _save(fig, path)
    plt.close(fig)
    return path


def decode_plot(series: list[ModelSeries], context: int, path: Path, price: float) -> Path | None:
    plt = _pyplot()
    rows = [(s, sorted((r for r in s.decode if r["context"] == context), key=lambda r: r["batch"])) for s in series]
    rows = [(s, pts) for s, pts in rows if pts]
    if not rows:
        return None
    fig, (cost, tput) = plt.subplots(1, 2, figsize=(12, 5))
    for s, pts in rows:
        user = [r["tok_s_per_user"] for r in pts]
        line, = cost.plot(user, [r["usd_per_M_output"] for r in pts], "o-", label=s.legend(context))
        tput.plot(user, [r["tok_s_per_gpu"] for r in pts], "o-", color=line.get_color())
        for r in pts:
            for ax, y in ((cost, r["usd_per_M_output"]), (tput, r["tok_s_per_gpu"])):
                ax.annotate(f"b{r['batch']}", (r["tok_s_per_user"], y), textcoords="offset points", xytext=(4, 4),
                            fontsize=8)
    cost.set_yscale("log")
    cost.set_ylabel(f"\\$ per M output tokens (at \\${price:.2f}/GPU-hour, log)")
    cost.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    tput.set_ylabel("output tokens/s per GPU")
    for ax in (cost, tput):
        ax.set_xlabel("output tokens/s per user")
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(*cost.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=9)
    fig.suptitle(f"Decode at context {_short(context)}: speed vs cost over batch sizes (H200, CUDA graphs)")
    _save(fig, path)
    plt.close(fig)
    return path


def write_all(series: list[ModelSeries], out_dir: Path, price: float) -> list[Path]:
    out = [prefill_plot(series, out_dir / "prefill.png", price)]
    for ctx in sorted({r["context"] for s in series for r in s.decode}):
        out.append(decode_plot(series, ctx, out_dir / f"decode_ctx{ctx}.png", price))
    return [p for p in out if p is not None]
