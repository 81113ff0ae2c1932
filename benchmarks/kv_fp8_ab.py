"""FP8 KV against bf16 KV on one loaded model (issue 26), GPU: the same weights, process and
ceilings for both page dtypes, so the ratios are the point.

  prefill    batch-1 prefill of --prefill-lens with bf16 pages, then e4m3 pages (target: FP8 no more
             than 3 % slower at 8k; prefill stores, then reads its keys back dequantised into the ragged
             kernel, kernels/flashinfer_backend.py)
  decode     the decode worker's engine loop with CUDA graphs (bench_model.decode_section) at
             --contexts x --batches with e4m3 pages (target: >= 12,000 tok/s per GPU at >= 60 tok/s per
             user at 8k), and with bf16 pages at --bf16-batches for the A/B (32k batch 128 in the issue)

    python -m benchmarks.kv_fp8_ab --preset gpt-oss-20b     # JSON: $OUT/kv_fp8_ab_gpt-oss-20b.json
    python -m benchmarks.kv_fp8_ab --device cpu --preset tiny --attention torch --linear torch --moe torch \\
        --prefill-lens 64 --contexts 64 --batches 1,2 --bf16-contexts 64 --bf16-batches 2   # CPU smoke

Not a model_*.json: the results report's model series do not tell KV dtypes apart, so these rows
stay in their own file.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench_model import decode_section, prefill_section
from benchmarks.common import Results, environment, markdown_table, measure_ceilings, out_dir
from benchmarks.model_setup import build

FP8 = torch.float8_e4m3fn


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def summarize(res: Results, a: argparse.Namespace) -> dict:
    d = res.data
    pre = {(r["kv_dtype"], r["tokens"]): r["ms"] for k in ("prefill_bf16", "prefill_fp8")
           for r in d.get(k, {}).get("rows", [])}
    dec = {(r["kv_dtype"], r["context"], r["batch"]): r for k in ("decode_bf16", "decode_fp8")
           for r in d.get(k, {}).get("rows", []) if "skipped" not in r}
    out = {"prefill_fp8_over_bf16": {n: pre[("float8_e4m3fn", n)] / pre[("bfloat16", n)]
                                     for n in _ints(a.prefill_lens) if ("bfloat16", n) in pre and ("float8_e4m3fn", n) in pre},
           "decode_fp8": [{k: r[k] for k in ("context", "batch", "tok_s_per_gpu", "tok_s_per_user", "ratio_to_floor")}
                          for (dt, *_), r in dec.items() if dt == "float8_e4m3fn"],
           "decode_fp8_over_bf16_tok_s": {f"{c}x{b}": dec[("float8_e4m3fn", c, b)]["tok_s_per_gpu"] / r["tok_s_per_gpu"]
                                          for (dt, c, b), r in dec.items()
                                          if dt == "bfloat16" and ("float8_e4m3fn", c, b) in dec}}
    ok = [r for r in out["decode_fp8"] if r["context"] == 8192 and r["tok_s_per_user"] >= 60]
    out["targets"] = {"decode_8k_tok_s_per_gpu_at_60_per_user": max((r["tok_s_per_gpu"] for r in ok), default=None),
                      "decode_target": 12000, "prefill_8k_fp8_over_bf16": out["prefill_fp8_over_bf16"].get(8192),
                      "prefill_target": 1.03}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--attention", default="flashinfer")
    ap.add_argument("--moe", default="auto")
    ap.add_argument("--linear", default="scaled_mm")
    ap.add_argument("--prefill-lens", default="8192")
    ap.add_argument("--contexts", default="8192,32768", help="FP8 decode contexts")
    ap.add_argument("--batches", default="1,32,128,192,256",
                    help="FP8 decode batches (192: where 12k tok/s per GPU at 60 per user should fall)")
    ap.add_argument("--bf16-contexts", default="8192,32768", help="bf16 decode contexts (the A/B)")
    ap.add_argument("--bf16-batches", default="128")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    if a.moe == "auto":
        from kernels.registry import auto_moe_backend
        a.moe = auto_moe_backend(a.device, fp8=True, whole_experts=True)
    res = Results(out_dir() / f"kv_fp8_ab_{a.preset}.json", {"env": environment(), "args": vars(a)})
    with res.section("ceilings") as sec:
        ceil = measure_ceilings(a.device) if a.device == "cuda" else measure_ceilings(a.device, 1 << 24, 256)
        sec.update(ceil)
    t0 = time.monotonic()
    # the workers' defaults: FP8 experts, bf16 QKV/O
    model = build(a.preset, a.attention, a.linear, a.moe, device=a.device, fp8_attention=False)
    res.data["load_seconds"] = round(time.monotonic() - t0, 1)
    graphs = a.device == "cuda"
    for dt, name in ((torch.bfloat16, "bf16"), (FP8, "fp8")):  # prefill A/B back to back
        prefill_section(res, model, _ints(a.prefill_lens), ceil, 1, dt, name=f"prefill_{name}")
    decode_section(res, model, _ints(a.contexts), _ints(a.batches), ceil, 1, graphs, FP8, name="decode_fp8")
    decode_section(res, model, _ints(a.bf16_contexts), _ints(a.bf16_batches), ceil, 1, graphs, torch.bfloat16,
                   name="decode_bf16")
    res.data["summary"] = summarize(res, a)
    res.save()
    for name in ("prefill_bf16", "prefill_fp8"):
        print(f"\n## {name}\n" + markdown_table(res.data[name]["rows"], ["tokens", "kv_dtype", "ms", "TFLOPs"]))
    for name in ("decode_fp8", "decode_bf16"):
        rows = [r for r in res.data[name]["rows"] if "skipped" not in r]
        print(f"\n## {name}\n" + markdown_table(rows, ["context", "batch", "kv_dtype", "ms_per_step", "gpu_ms_graph_replay",
                                                     "tok_s_per_gpu", "tok_s_per_user", "ratio_to_floor"]))
    print("\nsummary:", res.data["summary"], flush=True)


if __name__ == "__main__":
    main()
