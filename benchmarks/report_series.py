"""The model runs on a results page: which files are model runs, their configuration label, and the
series the plots and tables draw (one per configuration: its newest run for prefill and for each
decode context, never a merge of runs), plus the newest HF-peer run of each model."""

from __future__ import annotations

from benchmarks.plots import ModelSeries
from benchmarks.report_load import Run


def _is_model(d: dict) -> bool:
    return "preset" in d.get("args", {}) and ("prefill" in d or "decode" in d)


def model_docs(docs: dict[str, dict]) -> list[tuple[str, dict]]:
    """Model benchmark files, ordered by GPUs then model (a model's reruns stay next to each other)."""
    runs = [(n, d) for n, d in docs.items() if _is_model(d)]
    return sorted(runs, key=lambda nd: (nd[1].get("world", 1), nd[1]["args"]["preset"], nd[0]))


def _plain(d: dict) -> bool:
    """A run of one --fusions setting: the defaults of its day (off before 2026-12-03, rope_store since;
    kernels.registry.DEFAULT_FUSIONS). An A/B lists several settings, separated by commas; a run that
    chose its prefill reads (--prefill-reads) is not the defaults' either."""
    return "," not in (d["args"].get("fusions") or "") and not d["args"].get("prefill_reads")


def _with_reads(fusions: str, reads: str | None) -> str:
    return fusions + (f" · reads {reads}" if reads else "")


def setting_of(r: dict) -> str:
    """A row's setting: its fusions, and its prefill reads where it chose them."""
    return _with_reads(r.get("fusions") or "off", r.get("reads"))


def fusion_settings(d: dict) -> list[str | None]:
    """The settings a model run measured: [None] for a plain run; an A/B (its rows carry "fusions", and
    "reads") gives one series per setting, never merged with the defaults'."""
    if _plain(d):
        return [None]
    rows = d.get("prefill", {}).get("rows", []) + d.get("decode", {}).get("rows", [])
    return sorted({setting_of(r) for r in rows})


def card_of(d: dict) -> str:
    """The GPU a run measured on, where it was not an H200 ("H100 80GB HBM3"), else "". Runs that did not
    record their GPU ran on the H200s of 2026-11/12 (report.sec_runs says "H200 (not recorded)")."""
    env = d.get("env") or {}
    gpu = str(env.get("gpu") or env.get("device") or "")
    return "" if not gpu or "H200" in gpu else gpu.removeprefix("NVIDIA ")


def opt_ins(d: dict) -> str:
    """What a model run switched on that the workers do not by default, for its label: FP8 QKV/O projections
    (bench_model runs them unless --bf16-attention; the workers' default is bf16) and e4m3 KV pages. Such a
    run is a configuration of its own: its figures never stand in the defaults' series or summary row."""
    a = d["args"]
    out = " · FP8 QKV/O" if a.get("bf16_attention") is False else ""
    return out + (f" · KV {a['kv_cache_dtype']}" if a.get("kv_cache_dtype") not in (None, "auto", "bf16") else "")


def label_of(d: dict, fusions: str | None = None) -> tuple[str, int]:
    """The configuration's label. An A/B run of fusion settings is labelled by `fusions` (one of its
    settings) or, without it, by its whole list: never the label of a plain run, which it must not
    replace when results folders are merged. A run on another GPU than an H200 says which (card_of): its
    figures must never stand in an H200's series."""
    if _plain(d):
        fusions = None  # a plain run: the defaults of its day (its rows say which)
    elif fusions is None:
        fusions = _with_reads(d["args"]["fusions"], d["args"].get("prefill_reads"))
    tp = int(d.get("world", 1))
    moe = f" MoE-{d['args']['moe_mode'].upper()}" if tp > 1 and d["args"].get("moe_mode") else ""
    backend = d["args"].get("moe")  # the Triton MoE was the only one before DeepGEMM's: unlabelled
    kernels = f" · MoE {backend}" if backend not in (None, "triton") else ""
    kernels += f" · fusions {fusions}" if fusions else ""
    kernels += opt_ins(d)
    card = f" · {card_of(d)}" if card_of(d) else ""
    return f"{d['args']['preset']} TP{tp}{moe} · {d['args'].get('attention', '?')}{kernels}{card}", tp


def run_date(d: dict) -> str:
    return str((d.get("env") or {}).get("date") or "")


def source(name: str, d: dict, runs: dict[str, Run]) -> str:
    """How a legend or headline names a file: its run (or file name) and the date it ran."""
    run = runs.get(name)
    return f"{'run ' + run.run if run else name}, {run_date(d)[:10] or 'undated'}"


def build_series(docs: dict[str, dict], runs: dict[str, Run] | None = None) -> list[ModelSeries]:
    """One series per configuration (label_of): for prefill and for each decode context, the rows of the
    newest run that measured it, never a mix of runs (several runs on one line read as a zig-zag)."""
    out: dict[str, ModelSeries] = {}
    newest_first = sorted(model_docs(docs), key=lambda nd: (run_date(nd[1]), nd[0]), reverse=True)
    for n, d in newest_first:
        for fz in fusion_settings(d):
            label, tp = label_of(d, fz)
            s = out.setdefault(label, ModelSeries(label, tp, card=card_of(d)))
            src = source(n, d, runs or {})
            mine = (lambda r: True) if fz is None else (lambda r, fz=fz: setting_of(r) == fz)
            prefill = [r for r in d.get("prefill", {}).get("rows", []) if mine(r)]
            if prefill and "prefill" not in s.sources:
                s.prefill, s.sources["prefill"] = list(prefill), src
            decode = [r for r in d.get("decode", {}).get("rows", []) if "skipped" not in r and mine(r)]
            for ctx in sorted({r["context"] for r in decode} - set(s.sources)):
                s.decode += [r for r in decode if r["context"] == ctx]
                s.sources[ctx] = src
            for r in decode:
                s.points.setdefault((r["context"], r["batch"]), (r, src))
    return sorted(out.values(), key=lambda s: (s.gpus, s.label))


def peers(docs_newest_first: list[tuple[str, dict]], runs: dict[str, Run]) -> dict[str, tuple[str, dict]]:
    """preset -> (source, doc) of the newest model run that timed HF transformers beside it."""
    out: dict[str, tuple[str, dict]] = {}
    for n, d in sorted(docs_newest_first, key=lambda nd: run_date(nd[1]), reverse=True):
        if _is_model(d) and d.get("hf_peer", {}).get("rows"):
            out.setdefault(d["args"]["preset"], (source(n, d, runs), d))
    return out
