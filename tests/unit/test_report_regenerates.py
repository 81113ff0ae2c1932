"""`tandem bench report` reproduces what is committed: the merged results page, each dated folder's
page, the project README's performance table, and (with the matplotlib that drew them) the plots'
bytes. Regenerated into a temporary folder and compared, so an edit by hand or a stale page fails."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.report_summary import block_of

RESULTS = report.RESULTS
FOLDERS = [None] + [p.name for p in report.dated_folders()]


def png_software(path: Path) -> str | None:
    """The PNG's tEXt 'Software' value (plots.py writes the matplotlib version there)."""
    data = path.read_bytes()
    pos = 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"tEXt" and body.startswith(b"Software\0"):
            return body.split(b"\0", 1)[1].decode()
        if kind == b"zTXt" and body.startswith(b"Software\0"):
            return zlib.decompress(body.split(b"\0", 1)[1][1:]).decode()
        pos += 12 + length
    return None


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda f: f or "merged")
def test_page_and_plots_regenerate_unchanged(folder: str | None, tmp_path: Path):
    import matplotlib

    src = RESULTS / folder if folder else RESULTS
    page, text, pngs, _, _, _ = report.generate(src if folder else None, out=tmp_path)
    assert text == (src / "README.md").read_text(), f"{src}/README.md is stale: run `tandem bench report" + (
        f" --results {src}`" if folder else "`")
    assert sorted(p.name for p in pngs) == sorted(p.name for p in src.glob("*.png"))
    mine = f"matplotlib {matplotlib.__version__}"
    for p in pngs:
        committed = src / p.name
        if png_software(committed) != mine:
            pytest.skip(f"{committed} was drawn by {png_software(committed)}, this is {mine}: bytes not compared")
        assert p.read_bytes() == committed.read_bytes(), f"{committed} differs from what the report draws"


def test_readme_performance_table_is_the_generated_one(tmp_path: Path):
    _, _, _, summary, _, _ = report.generate(None, out=tmp_path, plots=False)
    assert block_of(report.README.read_text()) == summary
    assert all("not measured" in line or "run " in line for line in summary[2:7])  # each row names its run


def test_plot_lines_are_one_run_each():
    """Several runs of one configuration used to be drawn as one zig-zag line: now each line is the
    newest run that measured it, so its rows have one batch (decode) or length (prefill) each."""
    docs, _ = report.load_merged(report.dated_folders())
    for s in report.build_series(docs):
        assert len({r["tokens"] for r in s.prefill}) == len(s.prefill)
        keys = [(r["context"], r["batch"]) for r in s.decode]
        assert len(set(keys)) == len(keys), s.label
        assert set(s.sources) == ({"prefill"} if s.prefill else set()) | {r["context"] for r in s.decode}


def test_summary_cell_falls_back_to_an_older_run_that_measured_it():
    """A newer defaults run of fewer batch sizes keeps its rows on the plot lines, but must not blank a
    summary cell an older run measured: the cell reads the newest run that measured that point."""
    from benchmarks.report_summary import perf_summary

    def doc(date: str, batches: tuple[int, ...], ms: float) -> dict:
        rows = [{"context": 8192, "batch": b, "tok_s_per_user": 1e3 / ms, "tok_s_per_gpu": b * 1e3 / ms,
                 "usd_per_M_output": 1.0, "ratio_to_floor": 0.5} for b in batches]
        return {"args": {"preset": "gpt-oss-20b", "moe": "deepgemm", "attention": "flashinfer"},
                "env": {"date": date}, "decode": {"rows": rows}}

    docs = {"old.json": doc("2026-12-01", (1, 32, 128), 4.0), "new.json": doc("2026-12-04", (1,), 2.0)}
    series = report.build_series(docs)
    s = next(s for s in series if s.label.startswith("gpt-oss-20b"))
    assert [r["batch"] for r in s.decode] == [1]  # the plot line: the newest run only
    row = next(line for line in perf_summary(series, {}) if line.startswith("| gpt-oss-20b ("))
    cells = row.split(" | ")
    assert "500 tok/s" in cells[2] and "8,000 tok/s/GPU" in cells[3] and "32,000 tok/s/GPU" in cells[4]
    assert "old.json, 2026-12-01" in cells[0] and "new.json, 2026-12-04" in cells[0]


def test_summary_h200_row_never_reads_another_cards_run():
    """The summary promises one H200: a newer run on an H100 (lent when no H200 was) must not fill the
    H200 row; it gets a row of its own that names the card, and its plot line is labelled with it."""
    from benchmarks.report_summary import perf_summary

    def doc(date: str, gpu: str | None, ms: float) -> dict:
        rows = [{"context": 8192, "batch": 1, "tok_s_per_user": 1e3 / ms, "tok_s_per_gpu": 1e3 / ms,
                 "usd_per_M_output": 1.0, "ratio_to_floor": 0.5}]
        env = {"date": date} | ({"gpu": gpu} if gpu else {})
        return {"args": {"preset": "gpt-oss-20b", "moe": "deepgemm", "attention": "flashinfer"},
                "env": env, "decode": {"rows": rows}}

    docs = {"h200.json": doc("2026-12-02", "NVIDIA H200", 2.5),
            "h100.json": doc("2026-12-06", "NVIDIA H100 80GB HBM3", 2.0),
            "unrecorded.json": doc("2026-12-01", None, 4.0)}
    series = report.build_series(docs)
    assert sorted(s.card for s in series) == ["", "H100 80GB HBM3"]
    lines = perf_summary(series, {})
    h200 = next(line for line in lines if line.startswith("| gpt-oss-20b ("))
    h100 = next(line for line in lines if line.startswith("| gpt-oss-20b on one H100 80GB HBM3 ("))
    assert "400 tok/s" in h200 and "h200.json" in h200 and "h100.json" not in h200
    assert "500 tok/s" in h100 and "h100.json" in h100


def test_summary_defaults_row_never_reads_an_opt_in_run():
    """A newer run of a configuration the workers do not default to (FP8 QKV/O projections, e4m3 KV pages)
    must not fill the defaults' row, however few knobs it turned: it is a series of its own, labelled so."""
    from benchmarks.report_summary import perf_summary

    def doc(date: str, ms: float, **args) -> dict:
        rows = [{"context": 8192, "batch": 1, "tok_s_per_user": 1e3 / ms, "tok_s_per_gpu": 1e3 / ms,
                 "usd_per_M_output": 1.0, "ratio_to_floor": 0.5}]
        return {"args": {"preset": "gpt-oss-20b", "moe": "deepgemm", "attention": "flashinfer"} | args,
                "env": {"date": date, "gpu": "NVIDIA H200"}, "decode": {"rows": rows}}

    docs = {"defaults.json": doc("2026-12-06", 2.5, bf16_attention=True, kv_cache_dtype="auto"),
            "fp8-qkvo.json": doc("2026-12-07", 2.0, bf16_attention=False, kv_cache_dtype="auto"),
            "fp8-kv.json": doc("2026-12-07", 2.2, bf16_attention=True, kv_cache_dtype="fp8")}
    labels = sorted(s.label for s in report.build_series(docs))
    base = "gpt-oss-20b TP1 · flashinfer · MoE deepgemm"
    assert labels == [base, f"{base} · FP8 QKV/O", f"{base} · KV fp8"]
    row = next(line for line in perf_summary(report.build_series(docs), {}) if line.startswith("| gpt-oss-20b ("))
    assert "400 tok/s" in row and "defaults.json" in row and "fp8" not in row


def test_prefill_reads_ab_is_one_series_per_setting_never_the_defaults():
    """A run that A/Bs FlashInfer's prefill reads (bench_model --prefill-reads) with one fusion setting
    draws one line per reads setting, none of them labelled as the day's defaults."""
    def row(reads: str, ms: float) -> dict:
        return {"tokens": 8192, "ms": ms, "fusions": "rope_store", "reads": reads, "TFLOPs": 1.0,
                "ratio_fp8_peak": 0.5, "tokens_per_s_per_gpu": 1.0, "usd_per_M_input": 1.0}

    args = {"preset": "gpt-oss-20b", "moe": "deepgemm", "attention": "flashinfer", "fusions": "rope_store"}
    plain = {"args": args, "env": {"date": "2026-12-05"}, "prefill": {"rows": [row("", 90.0) | {"reads": None}]}}
    ab = {"args": args | {"prefill_reads": "paged,ragged"}, "env": {"date": "2026-12-06"},
          "prefill": {"rows": [row("paged", 85.0), row("ragged", 80.0)]}}
    series = {s.label: s for s in report.build_series({"plain.json": plain, "ab.json": ab})}
    plain_label = next(label for label in series if "reads" not in label)
    assert [r["ms"] for r in series[plain_label].prefill] == [90.0]
    assert {label.rsplit("reads ", 1)[1]: s.prefill[0]["ms"] for label, s in series.items() if "reads" in label} == {
        "paged": 85.0, "ragged": 80.0}
