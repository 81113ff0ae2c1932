"""Micro-benchmark of the sampler's stochastic step at gpt-oss's vocabulary (V = 201,088, fp32 logits):
the torch race of engine.sampling (argmax for the greedy rows, softmax(l / T), exponential_noise, divide,
argmax, where: what Sampler.sample ran before kernels/sampling.py) against the fused kernel
(kernels.sampling.fused_sample), at batch 1 / 64 / 128 / 256, temperature 1.

Per call, in milliseconds:
  * `graph_ms`: device time, REPS calls captured in one CUDA graph and replayed (no host launch cost);
  * `eager_ms`: CUDA events around one eager call after warm-up (host launches included: the sampler
    runs outside the decode worker's CUDA graph, so this is closer to what a step pays);
  * `frac_copy`: the bytes-read roofline, R x V x 4 bytes per call over graph_ms, against the copy
    bandwidth (bytes read + written) measured in the same run.
Also: parity at each batch (tokens equal to the torch race's; the rest must be near ties), the fraction
of q bit-identical to exponential_noise's, and a small sweep of the kernel's launch shape (BLOCK,
warps, programs per SM) at batch 64 and 256 (kernels.sampling's defaults are the first row).

    python -m benchmarks.sampling [--batches 1,64,128,256] [--reps 20]   # writes $OUT/sampling.json
    python -m benchmarks.sampling --smoke                                  # the script on the CPU interpreter
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import environment, markdown_table, out_dir, time_cuda  # noqa: E402
from benchmarks.common import graph_ms as cuda_graph_ms  # noqa: E402
from engine.sampling import _race, exponential_noise  # noqa: E402
from kernels import sampling as ks  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
V = 3000 if SMOKE else 201_088
SWEEP = [(ks.BLOCK, ks.NUM_WARPS, ks.PROGRAMS_PER_SM), (1024, 4, 16), (2048, 4, 8), (2048, 8, 8), (4096, 8, 4),
         (512, 4, 16)]


def graph_ms(fn, reps: int) -> float:
    """Device milliseconds per fn() from a CUDA graph of `reps` calls (median of 10 replays); on the CPU
    (smoke) the host clock."""
    if not torch.cuda.is_available() or SMOKE:
        return time_cuda(fn, warmup=1, iters=3)
    return cuda_graph_ms(fn, reps)


def copy_gbps() -> float:
    """Device copy bandwidth, bytes read + written, on 2 x 512 MiB (2 x 4 MiB in the smoke)."""
    x = torch.empty(1 << (22 if SMOKE else 29), dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / (graph_ms(lambda: y.copy_(x), 5) * 1e-3) / 1e9


def inputs(r: int) -> tuple[torch.Tensor, ...]:
    """logits [R, V] fp32, temp [R] (1.0), seeds [R], positions [R], noise [R] (all rows stochastic)."""
    g = torch.Generator(device=DEV).manual_seed(r)
    logits = torch.randn(r, V, device=DEV, generator=g) * 2.0
    temp = torch.ones(r, device=DEV)
    seeds = torch.randint(0, 2**62, (r,), device=DEV, generator=g)
    positions = torch.randint(0, 1 << 17, (r,), device=DEV, generator=g)
    return logits, temp, seeds, positions, torch.ones(r, dtype=torch.bool, device=DEV)


def torch_step(logits, temp, seeds, positions, noise) -> torch.Tensor:
    """The unfused Sampler's stochastic step: greedy argmax, the race, the per-row choice."""
    return torch.where(noise, _race(logits, temp, seeds, positions, None), logits.argmax(-1))


def batch_rows(r: int, reps: int, copy: float) -> list[dict]:
    args = inputs(r)
    nbytes = r * V * 4
    rows = []
    for name, fn in (("torch", lambda: torch_step(*args)), ("fused", lambda: ks.fused_sample(*args))):
        g_ms = graph_ms(fn, reps)
        rows.append({"batch": r, "path": name, "graph_ms": g_ms, "eager_ms": time_cuda(fn, warmup=2, iters=10),
                     "GBps": nbytes / (g_ms * 1e-3) / 1e9, "frac_copy": nbytes / (g_ms * 1e-3) / 1e9 / copy})
    rows[1]["speedup"] = rows[0]["graph_ms"] / rows[1]["graph_ms"]
    rows[1]["speedup_eager"] = rows[0]["eager_ms"] / rows[1]["eager_ms"]
    want, got = torch_step(*args), ks.fused_sample(*args)
    rows[1]["tokens_equal"] = int((want == got).sum().item())
    return rows


def noise_parity(r: int) -> dict:
    _, _, seeds, positions, _ = inputs(r)
    h, q = ks.noise_bits(seeds, positions, V)
    from engine.sampling import noise_hash
    ref = exponential_noise(seeds, positions, V)
    return {"rows": r, "hash_equal": bool(torch.equal(h, noise_hash(seeds, positions, V))),
            "q_bit_identical": (q == ref).float().mean().item(),
            "q_max_abs_rel": ((q - ref).abs() / ref).nan_to_num(0.0).max().item()}


def sweep_rows(batches: list[int], reps: int, copy: float) -> list[dict]:
    rows = []
    for r in batches:
        args = inputs(r)
        for block, warps, pps in SWEEP:
            ms = graph_ms(lambda: ks.fused_sample(*args, block=block, num_warps=warps, programs_per_sm=pps), reps)
            rows.append({"batch": r, "block": block, "warps": warps, "programs_per_sm": pps, "graph_ms": ms,
                         "frac_copy": r * V * 4 / (ms * 1e-3) / 1e9 / copy})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4" if SMOKE else "1,64,128,256")
    ap.add_argument("--reps", type=int, default=2 if SMOKE else 20)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    copy = copy_gbps()
    print(f"copy {copy:.0f} GB/s (bytes read + written); V = {V:,}", flush=True)
    doc = {"env": environment(), "args": vars(a), "vocab": V, "ceilings": {"copy_GBps": copy}, "rows": [], "sweep": []}
    path = out_dir() / "sampling.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc["noise_parity"] = noise_parity(min(64, batches[-1]))
    print(f"noise: {doc['noise_parity']}", flush=True)
    for r in batches:
        got = batch_rows(r, a.reps, copy)
        doc["rows"] += got
        path.write_text(json.dumps(doc, indent=1))
        t, f = got
        print(f"R={r:<4} torch {t['graph_ms']:.3f} ms (eager {t['eager_ms']:.3f})  fused {f['graph_ms']:.3f} ms "
              f"(eager {f['eager_ms']:.3f}, {f['frac_copy']:.0%} of copy)  speedup x{f['speedup']:.1f}  "
              f"tokens equal {f['tokens_equal']}/{r}", flush=True)
    doc["sweep"] = sweep_rows([b for b in (64, 256) if b in batches] or batches[-1:], a.reps, copy)
    best = {r: min((x for x in doc["sweep"] if x["batch"] == r), key=lambda x: x["graph_ms"]) for r in
            {x["batch"] for x in doc["sweep"]}}
    for r, b in sorted(best.items()):
        print(f"sweep R={r}: best block {b['block']} warps {b['warps']} programs/SM {b['programs_per_sm']} "
              f"{b['graph_ms']:.3f} ms ({b['frac_copy']:.0%} of copy)", flush=True)
    path.write_text(json.dumps(doc, indent=1))
    print("\n" + markdown_table(doc["rows"], ["batch", "path", "graph_ms", "eager_ms", "GBps", "frac_copy",
                                              "speedup", "tokens_equal"]), flush=True)
    print("\n" + markdown_table(doc["sweep"], ["batch", "block", "warps", "programs_per_sm", "graph_ms", "frac_copy"]))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
