"""Attention parity + speed at gpt-oss dims (64 q / 8 kv heads, d 64, bf16, page 16, scattered pages).

One unattended script for the H200 (results table on stdout, JSON in $OUT/attention.json, rewritten
after every section so a crash loses nothing):
  1. ceilings measured in the same run: device copy bandwidth, bf16 matmul FLOP/s;
  2. parity vs an fp32 torch reference (kernels/reference.py on sampled rows) for the Triton
     backend and FlashInfer fa3/fa2: prompts 1..32k (full and window 128), a chunk on a cached
     prefix, batched decode 1..128 at 8k/32k context; relative error <= 1e-2, no NaN;
  3. timing (triton.testing.do_bench median): prefill TFLOP/s (causal/window-aware FLOPs) and decode
     GB/s of K/V read, for Triton, FlashInfer fa3/fa2 and the torch reference (small sizes), as
     ratios to the ceilings; a small Triton launch-config sweep; decode under a CUDA graph.
Backends: triton = the generic kernel for every step (TritonAttention(decode="off")), triton-decode =
the decode kernel of kernels/triton_decode.py for pure-decode steps (decode rows only: its prefill is
triton's), fi-fa3 / fi-fa2 = FlashInfer's own kernels (with e4m3 pages its fa2 decode variant; the
workers' FlashInfer default sends e4m3 decode to the triton-decode kernel instead). The decode
kernel's sweep (BLOCK_N x warps x stages on decode 128 x 8k, split targets on 64 x 8k; with --kv-fp8
also on bf16 pages against the generic kernel) prints the fraction of copy bandwidth per config and
the summary names the best: the default to pick (kernels/triton_decode.py DEFAULT_DECODE).
FlashInfer JIT variants (fa3 + fa2, window + full) build in a background thread while the Triton
sections run. The built .so files are packed into $OUT/flashinfer-cache.tar.xz (split into
<= 15 MiB parts); FLASHINFER_CACHE_TAR=<that file> restores them as AOT modules (no rebuild).

  python -m benchmarks.attention            # on the GPU (see scripts/fetch_gpu_wheels.sh)
  python -m benchmarks.attention --smoke    # tiny shapes on the CPU interpreter (script check)
  python -m benchmarks.attention --kv-fp8   # the same with e4m3 pages (per-head scales): decode GB/s
                                            # counts the halved bytes; JSON in $OUT/attention_fp8kv.json
"""

from __future__ import annotations

import threading
import time
import traceback

from benchmarks.attention_cases import (  # noqa: E402  first: sets TRITON_INTERPRET under --smoke
    CHUNK_NEW, CHUNK_PREFIX, CTX8K, FULL, SLIDING, Case, D, DECODE_B, DECODE_CTX, DEV, DT, HKV, HQ, KV_DT, KV_FP8,
    LONG, MIXED, OUT, P, PREFILL, REC, SMOKE, TORCH_B, W, bench_ms, init_inputs, make_case, parity, record_error)

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.flashinfer_cache import restore_cache, save_cache  # noqa: E402
from kernels.torch_backend import TorchAttention  # noqa: E402
from kernels.triton_attention import KernelConfig  # noqa: E402
from kernels.triton_attention_backend import TritonAttention  # noqa: E402
from kernels.triton_decode import DEFAULT_DECODE, DecodeConfig  # noqa: E402


def ceilings() -> None:
    if DEV.type != "cuda":
        REC.data["ceilings"] = {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0}
        return
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    # Best of three rounds: run fp8-kv-1 (2026-12-03) measured 827 GB/s and 106 TFLOP/s in its one
    # round right after the GPU tests' processes (4,258 GB/s the day before), which made every ratio
    # of that run 5x too high. The samples are kept, so a slow round shows.
    copy_ms = [bench_ms(lambda: y.copy_(x)) for _ in range(3)]
    mm_ms = [bench_ms(lambda: a @ b) for _ in range(3)]
    REC.data["ceilings"] = {"copy_GBps": 2 * x.numel() / min(copy_ms) / 1e6,
                            "matmul_TFLOPs": 2 * 8192 ** 3 / min(mm_ms) / 1e9,
                            "copy_ms_samples": copy_ms, "matmul_ms_samples": mm_ms}
    print(f"ceilings: copy {REC.data['ceilings']['copy_GBps']:.0f} GB/s (read+write), "
          f"bf16 matmul {REC.data['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


def impls(decode: bool = False) -> dict:
    """The backends of a case; decode cases add the decode kernel's row."""
    out = {"triton": TritonAttention(decode="off")}
    if decode:
        out["triton-decode"] = TritonAttention(decode="all")
    out.update(FI_IMPLS)
    return out


def parity_and_timing(kind: str, case: Case, backends: dict, time_it: bool) -> None:
    ceil = REC.data["ceilings"]
    for name, impl in backends.items():
        try:
            impl.plan(case.step)
            out = case.run(impl)
            rel, mx = parity(case, out)
            row = {"kind": kind, "backend": name, "q_lens": case.q_lens[:2], "batch": len(case.q_lens),
                   "ctx": max(case.kv_lens), "window": case.window, "hold_all": case.hold_all, "rel_err": rel,
                   "max_abs": mx, "ok": rel <= 1e-2}
            REC.data["parity"].append(row)
            line = (f"{kind:8s} {name:8s} B={len(case.q_lens):3d} ctx={max(case.kv_lens):6d} w={case.window} "
                    f"rel={rel:.2e}")
            if time_it:
                ms = bench_ms(lambda: case.run(impl))
                tf, gbs = case.flops() / ms / 1e9, case.kv_bytes() / ms / 1e6
                REC.data["timing"].append({**row, "ms": ms, "TFLOPs": tf, "GBps": gbs, "frac_matmul":
                                           tf / ceil["matmul_TFLOPs"], "frac_copy": gbs / ceil["copy_GBps"]})
                line += f"  {ms:8.3f} ms  {tf:6.1f} TFLOP/s ({tf / ceil['matmul_TFLOPs']:.0%})  " \
                        f"{gbs:6.0f} GB/s ({gbs / ceil['copy_GBps']:.0%})"
            print(line + ("" if rel <= 1e-2 else "   <-- FAIL"), flush=True)
        except Exception as e:
            record_error(f"{kind}/{name}", e)


def prefill_section() -> None:
    for n in PREFILL:
        for window in (None, W):
            case = make_case([n], [0], window, seed=n)
            parity_and_timing("prefill", case, impls(), time_it=n >= 1000 or SMOKE)
            del case
    # a sliding-layer chunk on a cached prefix (prefix from pages + new tokens dense, then store)
    parity_and_timing("chunk", make_case([37, CHUNK_NEW], [CHUNK_PREFIX, 3], W, hold_all=False, seed=7), impls(), False)
    parity_and_timing("mixed", make_case([1, MIXED, 1], [LONG // 4, 40, 90], None, seed=8), impls(), False)


def decode_section() -> None:
    for ctx in DECODE_CTX:
        for b in DECODE_B:
            case = make_case([1] * b, [ctx - 1] * b, None, seed=b)
            parity_and_timing("decode", case, impls(decode=True), time_it=True)
            if b == DECODE_B[-2]:
                parity_and_timing("decode", make_case([1] * b, [ctx - 1] * b, W, seed=b + 1), impls(decode=True),
                                  time_it=True)
            del case


def torch_reference_section() -> None:
    small = [make_case([LONG // 8], [0], None, seed=1), make_case([1] * TORCH_B, [CTX8K - 1] * TORCH_B, None, seed=2)]
    for case in small:
        parity_and_timing("prefill" if case.q_lens[0] > 1 else "decode", case, {"torch": TorchAttention()}, True)


def sweep_section() -> None:
    """A few Triton launch shapes on the two headline cases, to pick defaults from data."""
    hpp = HQ // HKV
    cases = {"prefill8k": (make_case([LONG], [0], None, seed=3),
                           [KernelConfig(128, 64, hpp, 8, 3), KernelConfig(128, 128, hpp, 8, 3),
                            KernelConfig(64, 64, hpp, 4, 3), KernelConfig(128, 64, 1, 8, 3)]),
             "decode64x8k": (make_case([1] * DECODE_B[-2], [CTX8K - 1] * DECODE_B[-2], None, seed=4),
                             [KernelConfig(16, 64, hpp, 4, 3), KernelConfig(16, 128, hpp, 4, 3),
                              KernelConfig(16, 64, hpp, 4, 4)])}
    for name, (case, cfgs) in cases.items():
        for cfg in cfgs:
            sweep_one(name, case, lambda c=cfg: TritonAttention(config=c, decode="off"), str(cfg))


def sweep_one(name: str, case: Case, make_impl, label: str) -> None:
    ceil = REC.data["ceilings"]
    try:
        impl = make_impl()
        impl.plan(case.step)
        rel, _ = parity(case, case.run(impl), max_seqs=4)
        ms = bench_ms(lambda: case.run(impl))
        row = {"case": name, "config": label, "ms": ms, "rel_err": rel, "TFLOPs": case.flops() / ms / 1e9,
               "GBps": case.kv_bytes() / ms / 1e6, "kv_dtype": str(case.kc.dtype)}
        row["frac_copy"] = row["GBps"] / ceil["copy_GBps"]
        REC.data["sweep"].append(row)
        print(f"sweep {name:16s} {label}  {ms:.3f} ms  {row['TFLOPs']:.0f} TFLOP/s "
              f"({row['TFLOPs'] / ceil['matmul_TFLOPs']:.0%})  {row['GBps']:.0f} GB/s "
              f"({row['frac_copy']:.3f} of copy)  rel={rel:.1e}" + ("" if rel <= 1e-2 else "   <-- FAIL"), flush=True)
    except Exception as e:
        record_error(f"sweep/{name}/{label}", e)


def decode_sweep_section() -> None:
    """The decode kernel's launch configs on decode 128 x 8k (issue 26's case; 1024 programs, no
    split), split targets on 64 x 8k (512 programs: splits fill the SMs), and with --kv-fp8 a few
    configs on bf16 pages against the generic kernel (whether bf16 pages should use it too)."""
    b = DECODE_B[-1]
    big = make_case([1] * b, [CTX8K - 1] * b, None, seed=6)
    grid = [(32, 1, 3), (64, 1, 3), (128, 1, 3), (64, 2, 3), (128, 2, 3), (64, 4, 3), (128, 4, 3),
            (64, 1, 2), (64, 1, 4), (128, 1, 2), (128, 1, 4), (32, 1, 4)]  # (BLOCK_N, warps, stages); 256 spills
    for bn, w, st in grid:
        cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
        sweep_one(f"decode{b}x8k", big, lambda c=cfg: TritonAttention(decode="all", decode_config=c), str(cfg))
    del big
    mid = make_case([1] * DECODE_B[-2], [CTX8K - 1] * DECODE_B[-2], None, seed=7)
    for pps in (2, 4, 8, 16):
        cfg = DecodeConfig(block_n=DEFAULT_DECODE.block_n, num_warps=DEFAULT_DECODE.num_warps,
                           num_stages=DEFAULT_DECODE.num_stages, programs_per_sm=pps)
        sweep_one(f"decode{DECODE_B[-2]}x8k", mid, lambda c=cfg: TritonAttention(decode="all", decode_config=c),
                  str(cfg))
    del mid
    if KV_FP8:
        bf = make_case([1] * b, [CTX8K - 1] * b, None, seed=8, kv_dtype=DT)
        sweep_one(f"decode{b}x8k-{str(DT).removeprefix('torch.')}", bf, lambda: TritonAttention(decode="off"),
                  "generic kernel (pick_config)")
        for bn, w, st in ((32, 1, 3), (64, 1, 2), (64, 2, 3), (64, 4, 3)):
            cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            sweep_one(f"decode{b}x8k-{str(DT).removeprefix('torch.')}", bf,
                      lambda c=cfg: TritonAttention(decode="all", decode_config=c), str(cfg))


def graph_section() -> None:
    """Decode B=64 x 8k as one captured forward (plan outside the graph, replay inside)."""
    if DEV.type != "cuda":
        return
    b, ctx = 64, 8192
    case = make_case([1] * b, [ctx - 1] * b, None, seed=5)
    for name, impl in list(FI_IMPLS.items()) + [("triton", TritonAttention(decode="off")),
                                                ("triton-decode", TritonAttention(decode="all"))]:
        try:
            ms, gbs, rel = _graph_decode(impl, case, b, ctx)
        except Exception as e:
            record_error(f"graph/{name}", e)
            continue
        REC.data["timing"].append({"kind": "decode-graph", "backend": name, "batch": b, "ctx": ctx, "ms": ms,
                                   "GBps": gbs, "frac_copy": gbs / REC.data["ceilings"]["copy_GBps"], "rel_err": rel})
        print(f"graph    {name:8s} B={b} ctx={ctx}  {ms:.3f} ms  {gbs:.0f} GB/s  rel={rel:.1e}", flush=True)


def _graph_decode(impl, case: Case, b: int, ctx: int) -> tuple[float, float, float]:
    impl.enable_cuda_graphs([b], max_pages_per_seq=ctx // P + 1)  # static tables, re-plannable
    impl.plan(case.step)
    case.run(impl)  # eager warm-up (Triton compiles, lazy tables built)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        case.run(impl)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = case.run(impl)
    graph.replay()
    rel, _ = parity(case, out, max_seqs=4)
    ms = bench_ms(graph.replay)
    return ms, case.kv_bytes() / ms / 1e6, rel


# ---- FlashInfer: build in the background, cache the JIT output ----------------------------------------
FI_IMPLS: dict = {}
FI_BUILD: dict = {}


def flashinfer_build() -> None:
    try:
        t0 = time.time()
        from kernels.flashinfer_backend import FlashInferAttention
        from kernels.flashinfer_host import AttentionDims, import_flashinfer
        from kernels.flashinfer_variants import build_variant
        fi = import_flashinfer()
        FI_BUILD.update({"version": fi.__version__, "restored_modules": restore_cache()})

        def build(backend, sliding, kv_dtype=None):
            t = time.time()
            key = f"{backend}_{'window' if sliding else 'full'}{'_kv_e4m3' if kv_dtype else ''}"
            try:
                build_variant(backend, DT, D, sliding, kv_dtype)
                FI_BUILD[f"{key}_s"] = round(time.time() - t, 1)
            except Exception as e:
                FI_BUILD[f"{key}_error"] = repr(e)[-2000:]

        threads = [threading.Thread(target=build, args=(b, s)) for b in ("fa3", "fa2") for s in (True, False)]
        if KV_FP8:  # our fa2 variant over e4m3 pages (decode); prefill reads them dequantised with fa3/fa2
            threads += [threading.Thread(target=build, args=("fa2", s, KV_DT)) for s in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dims = AttentionDims(HQ, HKV, D, P, DT, DEV, KV_DT)
        for name in ("fa3", "fa2"):
            if any(key.startswith(name) and key.endswith("_error") and "e4m3" not in key for key in FI_BUILD):
                continue  # its build failed once already; retrying would cost another build
            try:
                impl = FlashInferAttention(prefill_backend=name, decode_backend=name, fp8_decode="flashinfer")
                impl.prepare(dims, {FULL: None, SLIDING: W})
                if impl._fp8_fallback is not None:
                    FI_BUILD[f"{name}_kv_e4m3_fallback"] = "FP8-KV variant unavailable: runs on Triton"
                FI_IMPLS[f"fi-{name}"] = impl
            except Exception as e:
                FI_BUILD[f"{name}_error"] = repr(e)[-2000:]
        FI_BUILD["seconds"] = round(time.time() - t0, 1)
    except Exception as e:
        FI_BUILD["error"] = repr(e)
        FI_BUILD["trace"] = traceback.format_exc()[-3000:]


def main() -> None:
    init_inputs()
    REC.data["meta"] = {"torch": torch.__version__, "triton": triton.__version__, "smoke": SMOKE,
                        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                        "dims": {"hq": HQ, "hkv": HKV, "d": D, "page": P, "window": W, "dtype": str(DT),
                                 "kv_dtype": str(KV_DT)}}
    builder = threading.Thread(target=flashinfer_build) if DEV.type == "cuda" else None
    if builder is not None:
        builder.start()
    REC.section("ceilings", ceilings)
    REC.section("sweep", sweep_section)
    REC.section("decode kernel sweep", decode_sweep_section)
    if builder is not None:
        builder.join()
        REC.data["meta"]["flashinfer_build"] = dict(FI_BUILD)
        print(f"flashinfer: {FI_BUILD}", flush=True)
        REC.section("save flashinfer cache", lambda: REC.data["meta"].update(flashinfer_cache=save_cache(OUT)))
    REC.section("prefill", prefill_section)
    REC.section("decode", decode_section)
    REC.section("torch reference", torch_reference_section)
    REC.section("cuda graph", graph_section)
    REC.section("summary", summarize)
    bad = [r for r in REC.data["parity"] if not r["ok"]]
    REC.data["meta"]["parity_failures"] = len(bad)
    REC.save()
    print(f"done: {len(REC.data['parity'])} parity checks, {len(bad)} over 1e-2, {len(REC.data['errors'])} errors")


def summarize() -> None:
    """The two headline numbers per backend against their targets."""
    rows = {}
    for r in REC.data["timing"]:
        if r["kind"] == "prefill" and r["window"] is None and r["q_lens"][0] == LONG:
            rows.setdefault(r["backend"], {})["prefill_full_8k_TFLOPs"] = round(r["TFLOPs"], 1)
        if r["kind"] == "decode" and r["window"] is None and r["batch"] == DECODE_B[-2] and r["ctx"] == DECODE_CTX[0]:
            rows.setdefault(r["backend"], {})["decode_64x8k_frac_copy"] = round(r["frac_copy"], 3)
        if r["kind"] == "decode" and r["window"] is None and r["batch"] == DECODE_B[-1] and r["ctx"] == DECODE_CTX[0]:
            rows.setdefault(r["backend"], {})["decode_128x8k_frac_copy"] = round(r["frac_copy"], 3)
    for r in REC.data["sweep"]:
        if r["case"] in ("prefill8k", "decode64x8k") and "KernelConfig" in r["config"]:  # the generic kernel
            key = "best_sweep_prefill8k_TFLOPs" if r["case"] == "prefill8k" else "best_sweep_decode64x8k_GBps"
            val = r["TFLOPs"] if r["case"] == "prefill8k" else r["GBps"]
            best = rows.setdefault("triton", {})
            best[key] = round(max(best.get(key, 0.0), val), 1)
        elif "DecodeConfig" in r["config"] and r["rel_err"] <= 1e-2:  # the decode kernel, per sweep case
            best = rows.setdefault("triton-decode", {})
            key = f"best_sweep_{r['case']}_frac_copy"
            if r["frac_copy"] > best.get(key, 0.0):
                best[key] = round(r["frac_copy"], 3)
                best[f"best_sweep_{r['case']}_config"] = r["config"]
    targets = {"prefill_full_8k_TFLOPs": 300, "decode_64x8k_frac_copy": 0.70}
    if KV_FP8:  # issue 26: e4m3 pages, bandwidth counted on the halved bytes
        targets = {"prefill_full_8k_TFLOPs": 300, "decode_128x8k_frac_copy": 0.80}
    REC.data["summary"] = {"targets": targets, "kv_dtype": str(KV_DT), "backends": rows}
    print(f"summary (KV {KV_DT}; targets: " + ", ".join(f"{k} >= {v}" for k, v in targets.items()) + ")")
    for name, vals in rows.items():
        print(f"  {name:8s} " + "  ".join(f"{k}={v}" for k, v in vals.items()), flush=True)
    head = {n: v["decode_128x8k_frac_copy"] for n, v in rows.items() if "decode_128x8k_frac_copy" in v}
    best = rows.get("triton-decode", {}).get(f"best_sweep_decode{DECODE_B[-1]}x8k_frac_copy")
    print(f"decode {DECODE_B[-1]}x8k frac of copy ({str(KV_DT).removeprefix('torch.')} pages): "
          + " ".join(f"{n}={v}" for n, v in head.items()) + (f" best-sweep={best}" if best else "")
          + (" (target 0.8)" if KV_FP8 else ""), flush=True)


if __name__ == "__main__":
    main()
