"""`tandem bench report`: benchmarks/results/README.md and the PNG plots, from the committed JSON.

By default it reads every dated folder, newest first (a newer folder's file of the same name, or
model run of the same configuration, replaces an older one) and writes the plots and the summary
to benchmarks/results/; `--results FOLDER` reads that folder alone and writes into it (or
`--readme`). Every number comes from those JSON files; derived numbers (percentages, ratios across
files) say how they were derived. Targets are the ones each benchmark recorded in its JSON
(kernels), plus the KV-transfer targets below (kv_transfer records none). Re-running on the same
files gives the same README and PNGs (tests/unit/test_report_regenerates.py checks the committed ones).
The plots draw one line per configuration: its newest run, named with its date in the legend. The
merged page also writes the short performance table into the project README (report_summary.py).
Each file's run, suite and command come from the folder's suite.json (report_load.py).

    tandem bench report [--results benchmarks/results/2026-11-30 --readme PATH] [--no-plots] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from benchmarks import report_load
from benchmarks.plots import ModelSeries, write_all
from benchmarks.report_fmt import fmt, last_line, pct, table
from benchmarks.report_load import Run, load, runs_of
from benchmarks.report_series import _is_model, build_series, label_of, model_docs, peers, setting_of
from benchmarks.report_summary import perf_summary, update_readme
from benchmarks.report_targets import (KV_MAX_OVERLAP_SHARE, KV_MIN_GBPS, Target, allreduce_docs, allreduce_targets,
                                       kernel_targets, kv_targets, missed_goals)

RESULTS = Path(__file__).parent / "results"
README = Path(__file__).parents[1] / "README.md"
PRICE_PER_GPU_HOUR = 3.00  # the seed's nominal H200 price; benchmarks/common.py computes $/M with it


# ---- loading (report_load.py) --------------------------------------------------------------------------
def dated_folders(root: Path = RESULTS) -> list[Path]:
    return report_load.dated_folders(root)


def load_merged(folders: list[Path]) -> tuple[dict[str, dict], dict[str, str]]:
    return report_load.load_merged(folders, label_of, _is_model)


# ---- sections ------------------------------------------------------------------------------------------
def sec_runs(docs: dict[str, dict], folder: str, origin: dict[str, str] | None = None,
             runs: dict[str, Run] | None = None) -> list[str]:
    rows = []
    for n, d in docs.items():
        where = (origin or {}).get(n, folder)
        env = d.get("env") or d.get("meta") or {}
        a = d.get("args", {})
        if "preset" in a and ("fp32_real_widths" in d or "parity" in d):
            what = f"parity: {a['preset']}"
            cfg = f"attention={a.get('attention')}, {a.get('tokens')} tokens"
        elif "preset" in a:
            what = "model: " + label_of(d)[0]
            cfg = (f"attention={a.get('attention')} linear={a.get('linear', 'scaled_mm')} moe={a.get('moe', 'triton')}"
                   f"{' moe_mode=' + a['moe_mode'] if 'moe_mode' in a else ''}"
                   f"{' no CUDA graphs' if a.get('no_graphs') else ''}")
        elif "kv_transfer" in n:
            what = "KV transfer GPU0→GPU1"
            cfg = f"{a.get('layers')} layers, tokens {a.get('tokens')}, {a.get('iters')} iters"
        elif n.startswith("kernels_"):
            what, cfg = "kernels: " + n[len("kernels_"):-5], "full sweep" if not env.get("smoke") else "smoke"
        else:
            continue
        ceil = ", ".join(f"{k} {fmt(v)}" for k, v in d.get("ceilings", {}).items()
                         if isinstance(v, float) and k != "seconds")
        gpus = d.get("world") or env.get("gpus") or (2 if "kv_transfer" in n else 1)
        gpu = env.get("gpu") or env.get("device") or "H200 (not recorded)"
        run = (runs or {}).get(n)
        rows.append([f"`{where}/{n}`" if origin else f"`{n}`", run.run if run else "–", what, gpu, gpus,
                     env.get("torch"), env.get("triton"),
                     env.get("flashinfer") or env.get("flashinfer_build", {}).get("version"), env.get("cuda"),
                     env.get("date", where), cfg, ceil])
    return table(rows, ["file", "run", "what", "GPU", "GPUs", "torch", "triton", "flashinfer", "CUDA", "date",
                        "config", "ceilings measured in the run"])


def sec_suites(docs: dict[str, dict], runs: dict[str, Run]) -> list[str]:
    """The suite (or dated script) and command behind every file on the page, from suite.json."""
    used: dict[Run, list[str]] = {}
    for n in docs:
        if n in runs:
            used.setdefault(runs[n], []).append(n)
    rows = [[r.run, f"`{r.where}/suite.json`", r.suite, f"`{r.command}`", (r.commit or "not recorded")[:12],
             f"`{r.where}/{r.script}`" if r.script else "–", ", ".join(f"`{n}`" for n in sorted(files))]
            for r, files in used.items()]
    missing = sorted(set(docs) - set(runs))
    return (table(sorted(rows, key=lambda r: r[1] + r[0]),
                  ["run", "record", "suite", "command", "at commit", "script kept here", "files"])
            + ([f"No run recorded for: {', '.join(f'`{n}`' for n in missing)}.", ""] if missing else []))


def sec_prefill(docs: dict[str, dict]) -> list[str]:
    rows = []
    for n, d in model_docs(docs):
        fp8 = d.get("ceilings", {}).get("fp8_TFLOPs")
        for r in d.get("prefill", {}).get("rows", []):
            rows.append([label_of(d, setting_of(r))[0], r["tokens"], r["ms"], r["TFLOPs"], fp8, pct(r["ratio_fp8_peak"]),
                         r["tokens_per_s_per_gpu"], f"${r['usd_per_M_input']:.4f}", f"`{n}`"])
    return table(rows, ["model", "input tokens", "ms", "TFLOP/s per GPU", "FP8 peak (same run)", "of FP8 peak",
                        "tokens/s per GPU", "$/M input", "file"])


def sec_decode(docs: dict[str, dict]) -> list[str]:
    rows, gaps = [], []
    for n, d in model_docs(docs):
        copy = d.get("ceilings", {}).get("copy_GBps")
        for r in sorted(d.get("decode", {}).get("rows", []), key=lambda r: (r["context"], r["batch"])):
            if "skipped" in r:
                gaps.append(f"- {label_of(d)[0]}, context {r['context']} batch {r['batch']}: skipped ({r['skipped']})")
                continue
            rows.append([label_of(d, setting_of(r))[0], r["context"], r["batch"], r["ms_per_step"], r.get("gpu_ms_graph_replay"),
                         r["tok_s_per_user"], r["tok_s_per_gpu"], f"${r['usd_per_M_output']:.3f}", r["hbm_floor_ms"],
                         copy, pct(r["ratio_to_floor"]), f"`{n}`"])
        if "error" in d.get("decode", {}):
            gaps.append(f"- `{n}`: the decode sweep stopped after the rows above: "
                        f"`{last_line(d['decode']['error'])}`")
    out = table(rows, ["model", "context", "batch", "ms/step", "graph replay ms", "tok/s per user", "tok/s per GPU",
                       "$/M output", "HBM floor ms", "copy GB/s (same run)", "of floor", "file"])
    return out + (["Not measured:", "", *gaps, ""] if gaps else [])


def sec_allreduce(docs: dict[str, dict], targets: list[Target]) -> list[str]:
    out = [f"- {t.what}: {t.value} (target {t.target}: {'met' if t.met else '**missed**'})" for t in targets]
    out += [""] if out else []
    for n, d in allreduce_docs(docs):
        rows = [[r["tokens"], r["bytes"], r["nccl_us"], r.get("nccl_graph_us"), r.get("symm_one_shot_us"),
                 r.get("symm_one_shot_graph_us"), r.get("symm_one_shot_nocopy_graph_us"), r.get("symm_two_shot_graph_us"),
                 r.get("tandem_graph_us"), r.get("tandem_exact")]
                for r in d.get("allreduce", {}).get("rows", [])]
        if rows:
            out += [f"From `{n}` ({d.get('world')} GPUs; graph = per call inside a CUDA graph of 32 calls; ours = "
                    "kernels/allreduce.py, exact = bit-equal to the rank-ordered fp32 sum on every rank):", ""]
            out += table(rows, ["tokens × 2880 bf16", "bytes", "NCCL µs", "NCCL graph µs", "one-shot µs",
                                "one-shot graph µs", "one-shot kernel alone, graph µs", "two-shot graph µs",
                                "ours graph µs", "ours exact"])
    return out


def sec_hf_peer(docs: dict[str, dict]) -> list[str]:
    out = []
    for n, d in model_docs(docs):
        hp = d.get("hf_peer")
        if not hp:
            continue
        out += [f"HF transformers `GptOssForCausalLM` (bf16, eager) on the same weights, from `{n}`:", ""]
        out += table([[r["what"], r["hf_ms"], r["tandem_ms"], f"{r['speedup']:.1f}×"] for r in hp.get("rows", [])],
                     ["what", "HF ms", "tandem ms", "tandem speed-up"])
        out += ["HF's decode is timed at a 512-token context (benchmarks/hf_peer.py), tandem's at the first batch-1 "
                "decode row of the same file, so that ratio favours HF.", ""]
        ag = hp.get("agreement")
        if ag:
            out += [f"Top-1 agreement of tandem (FP8) with HF (bf16) over {ag['tokens']} tokens: "
                    f"{pct(ag['top1_agreement'])}, logits relative error {ag['logits_rel_err']:.3f} "
                    "(random weights; see Parity).", ""]
    return out


def sec_kernels(docs: dict[str, dict], targets: list[Target]) -> list[str]:
    out = ["A goal with several backends is met when one of them meets it.", "",
           *table([[t.area, t.what, t.value, t.target, "met" if t.met else "missed"] for t in targets],
                  ["kernel", "case", "measured", "target", ""])]
    moe = docs.get("kernels_moe.json")
    runs = [d for _, d in model_docs(docs) if d.get("ceilings", {}).get("copy_GBps")]
    if moe and runs:
        over = max((r.get("pct_copy_bw", 0) for r in moe["rows"]), default=0)
        copy, src = runs[0]["ceilings"]["copy_GBps"], next(n for n, d in model_docs(docs) if d is runs[0])
        t1 = [r for r in moe["rows"] if r["T"] == 1 and r["backend"] == "triton_fp8"]
        if over > 100 and t1:
            out += [f"The kernel benchmarks' copy ceiling ({moe['ceilings']['copy_TBps']} TB/s, a uint8 `copy_`) is "
                    f"below what the kernels themselves stream (MoE rows reach {over:.0f}% of it), so "
                    f"percentages of it flatter. Against the bf16 copy ceiling measured in `{src}` "
                    f"({fmt(copy)} GB/s) the batch-1 MoE streams its weights at " +
                    ", ".join(f"{r['model']} {pct(r['TBps'] * 1e3 / copy)}" for r in t1) + ".", ""]
    return out


def sec_parity(docs: dict[str, dict]) -> list[str]:
    out = []
    for n, d in docs.items():
        a = d.get("args", {})
        if "fp32_real_widths" in d:
            out += [f"`{n}`: {a.get('preset')} widths, first {a.get('fp32_layers')} layers, {a.get('tokens')} tokens, "
                    f"against HF fp32 ({a.get('attention')} attention):", ""]
            out += table([[r["model"], r["rel_err_vs_hf_fp32"], pct(r["top1_agreement"]), r["max_abs_err"]]
                          for r in d["fp32_real_widths"]["rows"]],
                         ["model", "logits rel. error vs HF fp32", "top-1 agreement", "max abs error"])
        if "parity" in d and "rows" in d["parity"]:
            out += [f"`{n}`: full {a.get('preset')} depth, {a.get('tokens')} tokens, random weights "
                    f"({a.get('attention')} attention):", ""]
            out += table([[r["a"], r["b"], r["rel_err"], pct(r["top1_agreement"])] for r in d["parity"]["rows"]],
                         ["a", "b", "logits rel. error", "top-1 agreement"])
    return out


def sec_disagg(docs: dict[str, dict]) -> list[str]:
    out = []
    for n, d in docs.items():
        if "all_identical" not in d or "rows" not in d:
            continue
        out += [f"From `{n}` (benchmarks/disagg_smoke.py: each prompt runs colocated and disaggregated; "
                "transfer GB/s is bytes over the transfer's own duration, which starts before the last prefill "
                "chunk and overlaps it, so it is not link bandwidth):", ""]
        out += table([[r["prompt_tokens"], r["identical"], r["ttft_s"] * 1e3, r["prefill_s"] * 1e3, r["transfer_MB"],
                       r["transfer_GBps"], r["itl_ms"]] for r in d["rows"]],
                     ["prompt tokens", "tokens identical to colocated", "TTFT ms", "prefill ms", "KV MB",
                      "transfer GB/s", "decode ms/token"])
        b = d.get("burst", {})
        out += [f"Burst of {b.get('requests')} concurrent requests: {fmt(b.get('tokens_per_s'))} output tokens/s; "
                f"every decode page returned: {fmt(d.get('decode_pages_all_returned'))}; all outputs identical to "
                f"colocated: {fmt(d.get('all_identical'))}.", ""]
    return out or ["No disaggregated GPU run in this folder.", ""]


def _vs_engine(run: dict) -> str:
    """benchmarks.serve_gpu's comparison with the engine of the same run, when there is one."""
    v = run.get("vs_engine") or {}
    if "itl_over_replay" in v and v["itl_over_replay"]:
        return f"mean ITL {v['itl_over_replay']:.3f}x graph replay (batch 1, {v['context']} ctx)"
    if "served_over_engine" in v:
        return (f"steady {v['served_steady_tok_s']:,.0f} tok/s = {v['served_over_engine']:.2f}x bench_model "
                f"(batch {v['batch']}, {v['context']} ctx); whole run {v['whole_run_tok_s']:,.0f}")
    return ""


def sec_serve(docs: dict[str, dict]) -> list[str]:
    rows = []
    for n, d in docs.items():
        for run in d.get("runs", []) if d.get("kind") == "tandem-bench-serve" else []:
            s, ld = run["summary"], run["load"]
            rows.append([f"`{n}`", run["label"], ld["request_rate"] or "inf", f"{ld['input_len']['lo']}–"
                         f"{ld['input_len']['hi']}", f"{ld['output_len']['lo']}–{ld['output_len']['hi']}",
                         f"{s['completed']}/{s['num_requests']}", s["request_throughput"], s["output_token_throughput"],
                         s["goodput"]["requests_per_s"], s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["tpot_ms"]["p50"],
                         s["tpot_ms"]["p99"], _vs_engine(run) or run.get("note") or ""])
    if not rows:
        return ["No serving benchmark in this folder yet. `tandem bench serve --launch both --serve-args "
                "\"--device cuda --checkpoint DIR\" --request-rate R --out serve_<model>.json` compares colocated "
                "and disaggregated serving on the same GPUs; its JSON is picked up here.", ""]
    return table(rows, ["file", "run", "req/s offered", "input", "output", "ok", "req/s", "out tok/s", "goodput req/s",
                        "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "note"])


def headline(series: list[ModelSeries], docs: dict[str, dict]) -> list[str]:
    out = []
    for s in series:
        p8 = next((r for r in s.prefill if r["tokens"] == 8192), None)
        if p8:
            out.append(f"- **{s.label}** ({s.sources['prefill']}) prefill of 8k tokens: {p8['ms']:.1f} ms, {p8['TFLOPs']:.0f} TFLOP/s per GPU "
                       f"({pct(p8['ratio_fp8_peak'])} of the run's FP8 peak), "
                       f"${p8['usd_per_M_input']:.4f}/M input tokens")
        for ctx in sorted({r["context"] for r in s.decode}):
            rows = sorted((r for r in s.decode if r["context"] == ctx), key=lambda r: r["batch"])
            b1, best = rows[0], max(rows, key=lambda r: r["tok_s_per_gpu"])
            out.append(f"- **{s.label}** ({s.sources[ctx]}) decode at {ctx} context: batch {b1['batch']} {b1['tok_s_per_user']:.0f} tok/s "
                       f"per user ({pct(b1['ratio_to_floor'])} of the HBM floor), ${b1['usd_per_M_output']:.2f}/M; "
                       f"batch {best['batch']} {best['tok_s_per_gpu']:,.0f} tok/s per GPU at "
                       f"{best['tok_s_per_user']:.0f} "
                       f"per user, ${best['usd_per_M_output']:.3f}/M output tokens")
    for _, d in model_docs(docs):
        for r in d.get("hf_peer", {}).get("rows", []):
            out.append(f"- vs HF transformers ({label_of(d)[0]}): {r['what']}: {r['speedup']:.1f}× faster "
                       f"({r['hf_ms']:.1f} → {r['tandem_ms']:.1f} ms)")
    return out + [""]


def summarised(docs: dict[str, dict]) -> set[str]:
    """The files some section above reads."""
    names = {n for n, _ in model_docs(docs)} | {f"kernels_{k}.json" for k in ("attention", "gemm", "moe")}
    return names | {n for n, d in docs.items() if "kv_transfer" in n or "fp32_real_widths" in d or "all_identical" in d
                    or "rows" in d.get("parity", {}) or d.get("kind") == "tandem-bench-serve"}


def render(folder: Path, docs: dict[str, dict], plots: list[Path], origin: dict[str, str] | None = None,
           runs: dict[str, Run] | None = None, peer: dict[str, tuple[str, dict]] | None = None,
           page_dir: Path | None = None, summary_series: list | None = None) -> tuple[str, list[str], list[Target]]:
    """folder: the results folder (one-folder page), or benchmarks/results/ with `origin` (merged page);
    runs: what produced each file (report_load.runs_of); page_dir: where the page goes (image links);
    summary_series: the series the summary table reads (the merged page: every folder's), else the page's."""
    runs = runs or {}
    series = build_series(docs, runs)
    ktargets = kernel_targets(docs)
    kv_lines, kvt = kv_targets(docs)
    art = allreduce_targets(docs)
    targets = ktargets + kvt + art
    missed = missed_goals(targets)
    n_goals = len({t.group or t.what for t in targets})
    rel = folder.name
    img = {p.name: f"![{p.stem}]({os.path.relpath(p, page_dir or folder)})" for p in plots}
    head = headline(series, docs)
    used = sorted(set((origin or {}).values()), reverse=True)
    source = (f"the JSON files in [`{rel}/`](./)" if not origin else
              "the newest result of each kind across " + ", ".join(f"[`{f}/`]({f}/)" for f in used)
              + " (a newer folder's file of the same name, or model run of the same configuration, replaces an "
                "older one; the file column says which folder each came from)")
    lines = [f"# Benchmark results ({rel if not origin else used[0] + ' and earlier'})", "",
             f"_Generated by `tandem bench report` from {source}; re-run it after adding "
             "results instead of editing this file. Every number below is read from those files; percentages and "
             "ratios are computed from numbers in the same file unless a line says otherwise._", "",
             "Model runs use full-size random weights in the checkpoint layout (HF MXFP4 experts converted to FP8 "
             "with 128×128 block scales), so speeds are real but outputs are not; routing over random weights is "
             f"roughly balanced. Cost: ${PRICE_PER_GPU_HOUR:.2f} per H200-hour (the seed's nominal price), "
             "$/M tokens = price / 3600 / (tokens/s per GPU) × 10⁶. Roofline ratios use the ceilings each run "
             "measured itself (FP8 matmul peak for prefill; the bytes decode must read over the measured copy "
             "bandwidth, the *HBM floor*, for decode).", "",
             "## Summary: one H200, the workers' defaults", "",
             *perf_summary(summary_series or series, peer if peer is not None else peers(list(docs.items()), runs)),
             "",
             "## Headline", "", *head,
             f"## Targets: {n_goals - len(missed)} of {n_goals} met", "",
             *(["Missed (the closest backend or case shown):", ""]
               + [f"- **{t.area}** — {t.what}: {t.value} (target {t.target})" for t in missed] + [""]
               if missed else ["All met.", ""]),
             "## Runs", "", *sec_runs(docs, rel, origin, runs),
             "## Suites and commands", "", "What produced each file above: the suite (or, before `tandem bench suite`, "
             "the dated run script, run from scripts/gpu/ at the commit shown) and its command, from the folder's "
             "`suite.json`.", "", *sec_suites(docs, runs),
             "## Prefill (batch 1)", "", *([img["prefill.png"], ""] if "prefill.png" in img else []),
             *sec_prefill(docs),
             "## Decode (CUDA graphs)", "",
             *[f"{img[k]}\n" for k in sorted((k for k in img if k.startswith("decode_ctx")),
                                             key=lambda k: int(re.sub(r"\D", "", k)))],
             *sec_decode(docs),
             "## All-reduce latency (decode-sized messages)", "", *sec_allreduce(docs, art),
             "## HF transformers peer", "", *sec_hf_peer(docs),
             "## Kernels vs their targets", "", *sec_kernels(docs, ktargets),
             "## KV transfer (GPU0 → GPU1, gpt-oss-120b-shaped KV)", "",
             f"Targets as the project README states them (the benchmark records none): NIXL into contiguous decode "
             f"pages >= {KV_MIN_GBPS:g} GB/s; layer-overlapped sending adds <= {pct(KV_MAX_OVERLAP_SHARE)} to the "
             "prefill it overlaps.", "", *kv_lines,
             "## Disaggregated path on GPUs (wire protocol, no HTTP)", "", *sec_disagg(docs),
             "## Parity", "", *sec_parity(docs),
             "## Serving (`tandem bench serve`)", "", *sec_serve(docs)]
    others = sorted(set(docs) - summarised(docs))
    if others:
        lines += ["## Other files in the folder (not summarised here)", "",
                  *[f"- `{n}`: keys {', '.join(sorted(docs[n]))[:200]}" for n in others]]
    return "\n".join(lines).rstrip() + "\n", head, missed


def generate(results: Path | None, out: Path | None = None, readme: Path | None = None, plots: bool = True
             ) -> tuple[Path, str, list[Path], list[str], list[str], list[Target]]:
    """The page (and plots) for one dated folder, or the merged page when `results` is None, written into
    `out` (default: the folder itself / benchmarks/results). Returns (page, text, plots, summary table,
    headline, missed targets)."""
    if results:
        folder, docs, origin = results, load(results), None
        runs = runs_of(results, RESULTS)
        peer = peers(list(docs.items()), runs)
        summary_series = None
    else:
        folder = RESULTS
        folders = dated_folders()
        docs, origin = load_merged(folders)
        by_folder = {f.name: runs_of(f, RESULTS) for f in folders}
        runs = {n: by_folder[origin[n]][n] for n in docs if n in by_folder[origin[n]]}
        loaded = {f.name: load(f) for f in folders}
        peer = peers([(n, d) for f in folders for n, d in loaded[f.name].items()],
                     {n: r for f in folders for n, r in by_folder[f.name].items()})
        # The summary's cells come from every folder: a newer run of a configuration that measured fewer cells
        # (batch 1 only, say) replaces the older run on the page, but not the older run's other cells.
        summary_series = build_series({f"{f.name}/{n}": d for f in folders for n, d in loaded[f.name].items()},
                                      {f"{f.name}/{n}": r for f in folders for n, r in by_folder[f.name].items()})
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    page = readme or out / "README.md"
    series = build_series(docs, runs)
    pngs = write_all(series, out, PRICE_PER_GPU_HOUR) if plots else sorted(out.glob("*.png"))
    text, head, missed = render(folder, docs, pngs, origin, runs, peer, page_dir=page.parent,
                                summary_series=summary_series)
    page.write_text(text)
    return page, text, pngs, perf_summary(summary_series or series, peer), head, missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench report", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=None,
                   help="one dated results folder (default: all of them, the newest result of each kind)")
    p.add_argument("--readme", type=Path, default=None,
                   help="default: README.md in the output folder")
    p.add_argument("--out", type=Path, default=None,
                   help="write the page and plots here (default: the results folder itself)")
    p.add_argument("--no-plots", action="store_true", help="keep the plots already in the output folder")
    a = p.parse_args(argv)
    page, _, pngs, summary, head, missed = generate(a.results, a.out, a.readme, plots=not a.no_plots)
    print("\n".join(head))
    print(f"{len(missed)} goal(s) missed (closest case shown):" if missed else "all targets met")
    for t in missed:
        print(f"  {t.area}: {t.what}: {t.value} (target {t.target})")
    print(f"wrote {page}" + (f" and {len(pngs)} plot(s) in {page.parent}" if pngs and not a.no_plots else ""))
    if a.results is None and a.out is None:  # the merged page: the project README's table too
        if update_readme(README, summary):
            print(f"wrote the performance table into {README}")
        else:
            print(f"{README} has no perf-summary markers: table not written")
    return 0
