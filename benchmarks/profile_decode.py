"""Where a decode step's time goes: one eager 20b decode step under torch.profiler (CUDA kernels by
total time, launches per step), at batch 1 and 64 with 8k context; with --prefill-lens, where a
batch-1 prefill's goes too (issue 27's prefill goal: 8k tokens).

    python -m benchmarks.profile_decode --preset gpt-oss-20b [--fusions on] [--kv-cache-dtype fp8]
    python -m benchmarks.profile_decode --batches '' --prefill-lens 8192 --fp8-attention
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import out_dir
from benchmarks.model_setup import build, decode_state, fill_random
from kernels.registry import DEFAULT_FUSIONS, auto_moe_backend, parse_fusions
from model.context import SeqStep, build_step_meta
from model.kv_cache import SeqPages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--prefill-lens", default="", help="comma-separated prompt lengths to profile a prefill of")
    ap.add_argument("--fp8-attention", action="store_true", help="FP8 QKV/O projections (workers default: bf16)")
    ap.add_argument("--attention", default="flashinfer", choices=["flashinfer", "triton", "flashinfer-triton-decode"])
    ap.add_argument("--linear", default="scaled_mm", choices=["scaled_mm", "deepgemm", "triton"])
    ap.add_argument("--moe", default="auto", help="auto: what the workers pick (kernels.registry)")
    ap.add_argument("--kv-cache-dtype", default="bf16", choices=["bf16", "fp8"], help="KV pages (fp8: e4m3)")
    ap.add_argument("--fusions", default=DEFAULT_FUSIONS, help="kernels.registry.Fusion setting: off, on, or '+'-joined names")
    ap.add_argument("--prefill-reads", default="", help="FlashInfer prefill reads, e.g. ragged or ragged/fa2 "
                                                        "(benchmarks.bench_model.use_prefill_reads); default: the backend's")
    a = ap.parse_args()
    moe = auto_moe_backend("cuda:0", fp8=True, whole_experts=True) if a.moe == "auto" else a.moe
    model = build(a.preset, a.attention, a.linear, moe, fp8_attention=a.fp8_attention)
    model.backends.fusions = parse_fusions(a.fusions)
    if a.prefill_reads:
        from benchmarks.bench_model import use_prefill_reads
        use_prefill_reads(model, a.prefill_reads)
    suffix = ("" if a.fusions == DEFAULT_FUSIONS else f"_fusions-{a.fusions}") + (
        "_kv-fp8" if a.kv_cache_dtype == "fp8" else "") + ("_fp8-qkvo" if a.fp8_attention else "") + (
        "_reads-" + a.prefill_reads.replace("/", "-") if a.prefill_reads else "")
    kv_dtype = torch.float8_e4m3fn if a.kv_cache_dtype == "fp8" else None
    for b in [int(x) for x in a.batches.split(",") if x]:
        spec, pool, kv = decode_state(model, a.context + 32, b, kv_dtype)
        seqs = []
        for _ in range(b):
            p = SeqPages()
            kv.grow(p, a.context + 1)
            seqs.append(p)
        fill_random(pool)
        meta = build_step_meta([SeqStep(p, a.context, 1) for p in seqs], spec, model.device)
        ids = torch.randint(0, model.cfg.vocab_size, (b,), device=model.device)
        step = lambda: model.compute_logits(model(ids, meta, pool)).argmax(-1)  # noqa: E731
        table = profile_steps(step, 5)
        print(f"\n### batch {b}, context {a.context}, KV {a.kv_cache_dtype} (5 steps)\n{table}", flush=True)
        (out_dir() / f"profile_decode_b{b}{suffix}.txt").write_text(table)
        del pool, kv, seqs
    for n in [int(x) for x in a.prefill_lens.split(",") if x]:
        spec, pool, kv = decode_state(model, n + 16, 1, kv_dtype)
        pages = SeqPages()
        kv.grow(pages, n)
        meta = build_step_meta([SeqStep(pages, 0, n)], spec, model.device)
        ids = torch.randint(0, model.cfg.vocab_size, (n,), device=model.device)
        step = lambda: model.compute_logits(model(ids, meta, pool)[-1:]).argmax(-1)  # noqa: E731  (bench_model's)
        table = profile_steps(step, 3)
        print(f"\n### prefill {n} tokens, KV {a.kv_cache_dtype} (3 prefills)\n{table}", flush=True)
        (out_dir() / f"profile_prefill_{n}{suffix}.txt").write_text(table)
        del pool, kv


def profile_steps(step, reps: int) -> str:
    """torch.profiler's table of `reps` calls of `step` after 3 warm-up calls: kernels and the torch ops
    that launched them (aten::* rows: which op the elementwise kernels are), and kernels per call."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=70)
    kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return table + f"\nCUDA kernels per step: {kernels / reps:.0f}\n"


if __name__ == "__main__":
    main()
