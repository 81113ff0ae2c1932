"""Model-level GPU benchmark on full-size random weights materialised on the device (HF-layout
MXFP4 tensors generated in GPU memory, then converted to FP8 128x128 exactly like a checkpoint).

Sections (each saved as it finishes, so a failure keeps the rest):
  ceilings   copy bandwidth and bf16 / FP8 matmul rates measured in this run
  prefill    batch-1 prefill latency by prompt length: TFLOP/s vs FP8 peak, $/M input tokens
  decode     decode step time by (context, batch): the decode worker's overlapped engine loop (ms_per_step)
             next to its CUDA-graph replay and the synchronous loop; ms/token, tokens/s per GPU and
             per user, $/M output tokens, ratio to the HBM floor (bytes that must be read / bandwidth)
  hf_peer    HF transformers GptOssForCausalLM (bf16, eager) on the same weights: 8k prefill and
             batch-1 decode, plus top-1 agreement of our FP8 model with it

    python -m benchmarks.bench_model --preset gpt-oss-20b [--attention flashinfer] [--quick]
    python -m benchmarks.bench_model --preset gpt-oss-20b --kv-cache-dtype fp8   # e4m3 KV pages (issue 26)
    python -m benchmarks.bench_model --preset gpt-oss-20b --fusions off,on       # A/B of kernels.registry.Fusion

`--fusions` takes settings separated by commas (each off, on, or '+'-joined fusion names) and measures
each configuration once per setting on the same loaded model, rows tagged with their setting: prefill
timed in interleaved rounds, decode graphs captured per setting and their replays interleaved too, so
drift of the clock or the machine falls on every setting alike.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.common import (Results, dollars_per_million, environment, markdown_table, measure_ceilings, out_dir,
                               time_cuda)
from benchmarks.engine_loop import EXTRA_TOKENS, engine_loop_ms
from benchmarks.model_setup import build, decode_state, fill_random, floor_bytes_decode, prefill_flops
from model.context import SeqStep, build_step_meta
from kernels.registry import DEFAULT_FUSIONS, Fusion, fusions_name, parse_fusions
from model.kv_cache import KVManager, KVPool, SeqPages


def use_fusions(model, setting: str) -> str:
    """Switch the loaded model's fusions (kernels.registry.Fusion) to `setting`; returns its name."""
    model.backends.fusions = parse_fusions(setting)
    return fusions_name(model.backends.fusions)


def use_prefill_reads(model, setting: str) -> str:
    """Switch a FlashInfer model's prefill reads (FlashInferAttention.set_prefill_reads): 'FRESH' or
    'FRESH/SLIDING', e.g. paged, ragged, ragged/fa2. Returns the setting."""
    fresh, _, sliding = setting.partition("/")
    model.backends.attention.set_prefill_reads(fresh, sliding or None)
    return setting


def prefill_section(res: Results, model, lens: list[int], ceil: dict, tp: int, kv_dtype: torch.dtype | None = None,
                    name: str = "prefill", fusions: list[str] | None = None, reads: list[str] | None = None) -> None:
    """reads: prefill-read settings (use_prefill_reads) to A/B against each other, or None (the model's)."""
    settings = [(f, r) for f in fusions or [fusions_name(model.backends.fusions)] for r in reads or [None]]
    rounds = 3 if len(settings) > 1 else 1
    with res.section(name) as sec:
        for n in lens:
            spec, pool, kv = decode_state(model, n + 16, 1, kv_dtype)
            pages = SeqPages()
            kv.grow(pages, n)
            ids = torch.randint(0, model.cfg.vocab_size, (n,), device=model.device)
            meta = build_step_meta([SeqStep(pages, 0, n)], spec, model.device)

            def run():
                h = model(ids, meta, pool)
                return model.compute_logits(h[-1:])

            def use(s):
                use_fusions(model, s[0])
                if s[1] is not None:
                    use_prefill_reads(model, s[1])

            times: dict[tuple, list[float]] = {s: [] for s in settings}
            for _ in range(rounds):  # interleaved, so drift falls on every setting alike
                for s in settings:
                    use(s)
                    times[s].append(time_cuda(run, warmup=1, iters=3 if n >= 16384 else 5))
            for s in settings:
                ms = sorted(times[s])[len(times[s]) // 2]
                fl = prefill_flops(model.cfg, n)
                tps = n / (ms * 1e-3)
                row = {"tokens": n, "ms": ms, "kv_dtype": str(spec.dtype).removeprefix("torch."),
                       "fusions": use_fusions(model, s[0]), **({"reads": s[1]} if s[1] else {}),
                       "TFLOPs": fl / (ms * 1e-3) / 1e12 / tp,
                       "ratio_fp8_peak": fl / (ms * 1e-3) / 1e12 / tp / ceil["fp8_TFLOPs"],
                       "tokens_per_s_per_gpu": tps / tp, "usd_per_M_input": dollars_per_million(tps / tp)}
                if rounds > 1:
                    row["ms_rounds"] = times[s]
                sec["rows"].append(row)
                print(f"prefill {n:>6}: {ms:8.2f} ms  {row['TFLOPs']:6.1f} TFLOP/s/GPU  "
                      f"${row['usd_per_M_input']:.4f}/M  fusions {row['fusions']}"
                      + (f"  reads {s[1]}" if s[1] else ""), flush=True)
            del pool, kv, meta
            if model.device.type == "cuda":
                torch.cuda.empty_cache()


def decode_section(res: Results, model, contexts: list[int], batches: list[int], ceil: dict, tp: int,
                   graphs: bool, kv_dtype: torch.dtype | None = None, name: str = "decode",
                   fusions: list[str] | None = None) -> None:
    kv_elt = torch.empty((), dtype=kv_dtype or model.dtype).element_size()  # 1 for e4m3 pages
    settings = fusions or [fusions_name(model.backends.fusions)]
    rounds = 3 if len(settings) > 1 else 1
    with res.section(name) as sec:
        for ctx in contexts:
            for b in batches:
                free = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else 8 << 30
                if tp > 1:  # every rank must take the same branch, or the collectives hang
                    t = torch.tensor([free], dtype=torch.int64, device=model.device)
                    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
                    free = int(t.item())
                need = b * (ctx + 32) * model.cfg.kv_bytes_per_token(kv_elt) / 2 / tp
                if need > 0.85 * free:
                    sec["rows"].append({"context": ctx, "batch": b, "skipped": f"KV needs {need / 2**30:.0f} GiB"})
                    continue
                # one spare sequence's pages per extra setting: each graph runner reserves a padding page
                spec, pool, kv = decode_state(model, ctx + EXTRA_TOKENS, b + len(settings) - 1, kv_dtype)
                seqs = []
                for _ in range(b):
                    p = SeqPages()
                    kv.grow(p, ctx + 1)
                    seqs.append(p)
                fill_random(pool)
                steps = [SeqStep(p, ctx, 1) for p in seqs]
                ids = torch.randint(0, model.cfg.vocab_size, (b,), device=model.device)
                runners: dict[str, object] = {}
                replays: dict[str, list[float]] = {s: [] for s in settings}
                if graphs:
                    from engine.decode_graphs import CudaGraphDecoder

                    for s in settings:  # one graph per setting, captured with its fusions
                        use_fusions(model, s)
                        runners[s] = CudaGraphDecoder(model, pool, kv, b, ctx + EXTRA_TOKENS + 16, buckets=(b,))
                        runners[s].capture()
                    for _ in range(rounds):  # interleaved replays
                        for s in settings:
                            runners[s].prepare(ids, steps)
                            replays[s].append(time_cuda(lambda: runners[s].replay(b, b), warmup=3, iters=20))
                for s in settings:
                    label = use_fusions(model, s)
                    runner = runners.get(s)
                    gpu_ms = sorted(replays[s])[len(replays[s]) // 2] if runner is not None else None
                    if runner is not None:
                        fn = lambda: runner.run(ids, steps).argmax(-1)  # noqa: E731
                    else:
                        meta = build_step_meta(steps, spec, model.device)
                        fn = lambda: model.compute_logits(model(ids, meta, pool)).argmax(-1)  # noqa: E731
                    # one synchronous step without the engine: host metadata + plan + forward + argmax
                    bare_ms = time_cuda(fn, warmup=3, iters=20)
                    # the decode worker's loop (engine.core): overlapped, and synchronous for the A/B
                    ms = engine_loop_ms(model, pool, kv, seqs, runner, ctx, overlap=True)
                    sync_ms = engine_loop_ms(model, pool, kv, seqs, runner, ctx, overlap=False)
                    floor_ms = floor_bytes_decode(model.cfg, b, ctx, kv_elt) / tp / (ceil["copy_GBps"] * 1e9) * 1e3
                    row = {"context": ctx, "batch": b, "kv_dtype": str(spec.dtype).removeprefix("torch."),
                           "fusions": label, "ms_per_step": ms, "ms_per_step_sync_loop": sync_ms,
                           "ms_per_step_bare": bare_ms, "step_to_replay": ms / gpu_ms if gpu_ms else None,
                           "tok_s_per_user": 1e3 / ms,
                           "tok_s_per_gpu": b * 1e3 / ms / tp,
                           "usd_per_M_output": dollars_per_million(b * 1e3 / ms / tp),
                           "hbm_floor_ms": floor_ms, "ratio_to_floor": floor_ms / ms, "cuda_graphs": graphs,
                           "gpu_ms_graph_replay": gpu_ms}
                    if rounds > 1 and runner is not None:
                        row["replay_ms_rounds"] = replays[s]
                    sec["rows"].append(row)
                    print(f"decode ctx {ctx:>6} batch {b:>4}: {ms:7.3f} ms/step (replay {gpu_ms or 0:.3f}, sync loop "
                          f"{sync_ms:.3f}, bare {bare_ms:.3f})  "
                          f"{row['tok_s_per_gpu']:8.0f} tok/s/GPU "
                          f"{row['tok_s_per_user']:6.1f} tok/s/user  floor {floor_ms:.3f} ms ({row['ratio_to_floor']:.0%})"
                          f"  fusions {label}", flush=True)
                del runner, runners, pool, kv, seqs
                gc.collect()
                if model.device.type == "cuda":
                    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--attention", default="flashinfer")
    ap.add_argument("--moe", default="auto", help="triton | deepgemm | auto: what a worker would pick (kernels/registry.py)")
    ap.add_argument("--linear", default="scaled_mm")
    ap.add_argument("--prefill-lens", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--bf16-attention", action="store_true", help="QKV/O projections in bf16 (experts stay FP8)")
    ap.add_argument("--hf-peer", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8"],
                    help="KV pages of the prefill and decode sections (auto = the model dtype, bf16)")
    ap.add_argument("--fusions", default=DEFAULT_FUSIONS,
                    help="kernel fusions (kernels.registry.Fusion): one setting, or several separated by commas for "
                         "an A/B on the same model, e.g. off,rope_store,norm_router,norm_quant,on")
    ap.add_argument("--prefill-reads", default="",
                    help="FlashInfer prefill reads to A/B in the prefill section, separated by commas: paged, ragged, "
                         "ragged/fa2 (FlashInferAttention.set_prefill_reads); default: the backend's")
    ap.add_argument("--norm-quant-max-tokens", type=int, default=None,
                    help="kernels.registry.NORM_QUANT_MAX_TOKENS for this run (norm_quant's token range), e.g. to A/B "
                         "norm_quant at prefill sizes")
    ap.add_argument("--mxfp4-dot", default="", choices=["", "fp32", "f16_cvt", "f16_lop"],
                    help="the model's MXFP4 MoE (Fusion.MXFP4_MOE) in this form of kernels.moe_mxfp4.Mxfp4Config.dot, "
                         "8 rows on one warp, instead of the default config")
    ap.add_argument("--tag", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny presets)")
    a = ap.parse_args()
    if a.norm_quant_max_tokens is not None:
        from kernels import registry
        registry.NORM_QUANT_MAX_TOKENS = a.norm_quant_max_tokens
    if a.moe == "auto":  # recorded as the backend it resolved to
        from kernels.registry import auto_moe_backend
        a.moe = auto_moe_backend(a.device, fp8=True, whole_experts=True)
    tag = a.tag or f"{a.preset}-tp1" + ("" if a.kv_cache_dtype == "auto" else f"-kv{a.kv_cache_dtype}")
    res = Results(out_dir() / f"model_{tag}.json", {"env": environment(), "args": vars(a)})
    with res.section("ceilings") as sec:
        ceil = measure_ceilings(a.device) if a.device == "cuda" else measure_ceilings(a.device, 1 << 24, 256)
        sec.update(ceil)
        print("ceilings:", {k: round(v) for k, v in ceil.items()}, flush=True)
    t0 = time.monotonic()
    model = build(a.preset, a.attention, a.linear, a.moe, device=a.device, fp8_attention=not a.bf16_attention,
                  # an arm names mxfp4_moe: keep the MXFP4 experts too ("on" does not: 120b has no room for both)
                  mxfp4_experts=Fusion.MXFP4_MOE.value in a.fusions)
    res.data["load_seconds"] = round(time.monotonic() - t0, 1)
    if a.mxfp4_dot:
        from kernels.moe_mxfp4 import Mxfp4Config
        for layer in model.layers:
            layer.mlp.use_mxfp4_config(Mxfp4Config(dot=a.mxfp4_dot, num_warps=1))
    settings = [s for s in a.fusions.split(",") if s.strip()] or ["off"]
    use_fusions(model, settings[0])
    print(f"loaded {a.preset} FP8 in {res.data['load_seconds']} s; {model.backends.describe()}"
          + (f"; fusion settings {settings}" if len(settings) > 1 else ""), flush=True)
    from model.kv_cache import resolve_kv_dtype
    kv_dtype = resolve_kv_dtype(a.kv_cache_dtype, model.dtype)
    reads = [r for r in a.prefill_reads.split(",") if r.strip()] or None
    prefill_section(res, model, [int(x) for x in a.prefill_lens.split(",") if x], ceil, 1, kv_dtype, fusions=settings,
                    reads=reads)
    decode_section(res, model, [int(x) for x in a.contexts.split(",") if x], [int(x) for x in a.batches.split(",") if x],
                   ceil, 1, not a.no_graphs and a.device == "cuda", kv_dtype, fusions=settings)
    use_fusions(model, settings[0])
    if a.hf_peer:
        from benchmarks.hf_peer import hf_peer_section

        hf_peer_section(res, model, a.preset, res.data.get("prefill", {}).get("rows", []),
                        res.data.get("decode", {}).get("rows", []))
    res.save()
    for name, cols in (("prefill", ["tokens", "fusions", *(["reads"] if reads else []), "ms", "TFLOPs", "ratio_fp8_peak", "usd_per_M_input"]),
                       ("decode", ["context", "batch", "fusions", "ms_per_step", "gpu_ms_graph_replay", "step_to_replay",
                                   "ms_per_step_sync_loop", "tok_s_per_gpu", "tok_s_per_user",
                                   "usd_per_M_output", "ratio_to_floor"]),
                       ("hf_peer", ["what", "hf_ms", "tandem_ms", "speedup"])):
        rows = [r for r in res.data.get(name, {}).get("rows", []) if "skipped" not in r]
        if rows:
            print(f"\n## {name}\n" + markdown_table(rows, cols))


if __name__ == "__main__":
    main()
