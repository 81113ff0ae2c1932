"""Multi-GPU model benchmark (one process per GPU, NCCL; NVLink multicast stays off):

  allreduce  latency of decode-sized all-reduces (NCCL, torch symmetric-memory one-shot / two-shot,
             and ours: kernels/allreduce.py, checked bit-exact against the rank-ordered fp32 sum)
  per model  prefill and decode sweeps as in bench_model, with attention TP over all ranks and the
             MoE either expert-parallel (TP-only dispatch/combine: one all-reduce) or TP-sliced

    torchrun --nproc-per-node 2 -m benchmarks.bench_tp --preset gpt-oss-120b --moe-mode ep
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.bench_model import decode_section, prefill_section
from benchmarks.common import Results, environment, markdown_table, measure_ceilings, out_dir, time_cuda
from benchmarks.model_setup import build
from model.parallel import MoEMode, ParallelConfig


def graph_us(fn, calls: int = 32, trials: int = 10) -> float:
    """Microseconds per call of `fn` inside a CUDA graph of `calls` back-to-back calls (how decode
    runs them: no launch gaps), median over replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return time_cuda(g.replay, warmup=3, iters=trials) * 1e3 / calls


def allreduce_section(res: Results, rank: int, world: int) -> None:
    """Decode-sized all-reduces: NCCL and the symmetric-memory one-shot path the model uses
    (model/parallel.py), each eager (one launch, event-timed) and inside a CUDA graph."""
    from model.parallel import _one_shot_all_reduce

    with res.section("allreduce") as sec:
        for tokens in (1, 8, 32, 64, 128, 256, 1024, 8192):
            torch.manual_seed(tokens)  # the same x on every rank: the sum is world * x
            x = torch.randn(tokens, 2880, dtype=torch.bfloat16, device="cuda")
            row = {"tokens": tokens, "bytes": x.numel() * 2}
            row["nccl_us"] = time_cuda(lambda: dist.all_reduce(x), warmup=5, iters=50) * 1e3
            try:
                row["nccl_graph_us"] = graph_us(lambda: dist.all_reduce(x))
            except Exception as e:  # noqa: BLE001 - record and go on
                row["nccl_graph_error"] = str(e)[:200]
            try:
                want = x.float() * world  # every rank holds the same x (same seed)
                got = _one_shot_all_reduce(x, None)
                row["symm_ok"] = bool(torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2))
                row["symm_one_shot_us"] = time_cuda(lambda: _one_shot_all_reduce(x, None), warmup=5, iters=50) * 1e3
                row["symm_one_shot_graph_us"] = graph_us(lambda: _one_shot_all_reduce(x, None))
                # the kernels alone, on a buffer already holding x (what a producer writing straight
                # into the symmetric buffer would pay): one-shot, and two-shot (reduce-scatter +
                # all-gather, in place)
                import torch.distributed._symmetric_memory as symm_mem
                name = dist.group.WORLD.group_name
                buf = symm_mem.empty(x.shape, dtype=x.dtype, device=x.device)
                symm_mem.rendezvous(buf, name)
                buf.copy_(x)
                row["symm_one_shot_nocopy_graph_us"] = graph_us(
                    lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name))
                row["symm_two_shot_graph_us"] = graph_us(
                    lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name))
            except Exception as e:  # noqa: BLE001 - optional fast path
                row["symm_one_shot_error"] = str(e)[:200]
            if tokens <= 256:
                try:
                    _tandem_rows(row, tokens, rank, world)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row["tandem_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            sec["rows"].append(row)
            if rank == 0:
                print(f"all-reduce {tokens:>5} tokens: NCCL {row['nccl_us']:.1f} us (graph "
                      f"{row.get('nccl_graph_us', float('nan')):.1f}), one-shot "
                      f"{row.get('symm_one_shot_us', float('nan')):.1f} us (graph "
                      f"{row.get('symm_one_shot_graph_us', float('nan')):.1f}, kernel alone "
                      f"{row.get('symm_one_shot_nocopy_graph_us', float('nan')):.1f}; two-shot "
                      f"{row.get('symm_two_shot_graph_us', float('nan')):.1f}) ok={row.get('symm_ok')}; tandem "
                      f"{row.get('tandem_us', float('nan')):.1f} us (graph {row.get('tandem_graph_us', float('nan')):.1f})"
                      f" exact={row.get('tandem_exact')} {row.get('tandem_error', '')}", flush=True)


def _tandem_rows(row: dict, tokens: int, rank: int, world: int) -> None:
    """Our one-shot kernel (kernels/allreduce.py): a different x per rank; every rank must get the
    rank-ordered fp32 sum bit for bit, also after graph replays (pads reset, buffers reused)."""
    from kernels.allreduce import OneShotAllReduce, reduce_sum_reference
    from model.parallel import _tandem_one_shot

    g = torch.Generator(device="cuda").manual_seed(1000 * tokens + rank)
    x = torch.randn(tokens, 2880, dtype=torch.bfloat16, device="cuda", generator=g)
    xs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(xs, x)
    want = reduce_sum_reference(xs)
    ar: OneShotAllReduce = _tandem_one_shot(None, 256 * 2880, x.device)
    got = ar(x)
    torch.cuda.synchronize()
    exact = bool(torch.equal(got, want))
    row["tandem_us"] = time_cuda(lambda: ar(x), warmup=5, iters=50) * 1e3
    row["tandem_graph_us"] = graph_us(lambda: ar(x))
    exact &= bool(torch.equal(ar(x), want))
    row["tandem_exact"] = exact


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--moe-mode", default="ep", choices=["ep", "tp"])
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--prefill-lens", default="2048,8192,32768")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,8,64,128")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--skip-allreduce", action="store_true")
    ap.add_argument("--bf16-attention", action="store_true")
    ap.add_argument("--fast-allreduce-kib", type=int, default=1024,
                    help="symmetric-memory one-shot all-reduce up to this many KiB (0 = NCCL only); "
                         "the workers' default is 1024")
    ap.add_argument("--fast-allreduce-impl", choices=["torch", "tandem"], default="torch")
    ap.add_argument("--vocab-parallel", action="store_true", help="lm_head split by vocabulary rows")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=timedelta(seconds=180))
    tag = f"{a.preset}-tp{world}-{a.moe_mode}" + (f"-oneshot{a.fast_allreduce_kib}k" if a.fast_allreduce_kib else "") + \
        ("-tandemar" if a.fast_allreduce_impl == "tandem" else "") + \
        ("-vocabpar" if a.vocab_parallel else "") + ("-allreduce-only" if not a.prefill_lens and not a.contexts else "")
    path = out_dir() / (f"model_{tag}.json" if rank == 0 else f".rank{rank}_{tag}.json")
    res = Results(path, {"env": environment(), "args": vars(a), "world": world})
    quiet = contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext()
    with quiet:
        if not a.skip_allreduce:
            allreduce_section(res, rank, world)
        with res.section("ceilings") as sec:
            ceil = measure_ceilings()
            sec.update(ceil)
        if not a.prefill_lens and not a.contexts:  # all-reduce latency only: no model
            res.save()
            dist.barrier()
            dist.destroy_process_group()
            return
        t0 = time.monotonic()
        par = ParallelConfig(world, rank, MoEMode(a.moe_mode), dist.group.WORLD, a.fast_allreduce_kib << 10,
                             a.fast_allreduce_impl, a.vocab_parallel)
        model = build(a.preset, a.attention, "scaled_mm", "triton", parallel=par, device=f"cuda:{rank}",
                      fp8_attention=not a.bf16_attention)
        res.data["load_seconds"] = round(time.monotonic() - t0, 1)
        print(f"loaded {a.preset} TP{world} MoE={a.moe_mode} in {res.data['load_seconds']} s", flush=True)
        prefill_section(res, model, [int(x) for x in a.prefill_lens.split(",") if x], ceil, world)
        decode_section(res, model, [int(x) for x in a.contexts.split(",") if x],
                       [int(x) for x in a.batches.split(",") if x], ceil, world, not a.no_graphs)
        res.save()
        for name, cols in (("allreduce", ["tokens", "nccl_us", "nccl_graph_us", "symm_one_shot_us",
                                         "symm_one_shot_graph_us", "symm_one_shot_nocopy_graph_us",
                                         "symm_two_shot_graph_us", "symm_ok", "tandem_us", "tandem_graph_us",
                                         "tandem_exact"]),
                           ("prefill", ["tokens", "ms", "TFLOPs", "ratio_fp8_peak", "usd_per_M_input"]),
                           ("decode", ["context", "batch", "ms_per_step", "gpu_ms_graph_replay", "tok_s_per_gpu",
                                       "tok_s_per_user", "usd_per_M_output", "ratio_to_floor"])):
            rows = [r for r in res.data.get(name, {}).get("rows", []) if "skipped" not in r]
            if rows:
                print(f"\n## {tag} {name}\n" + markdown_table(rows, cols), flush=True)
    del model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
