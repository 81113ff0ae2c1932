"""Shared by the model-level benchmarks: environment record, measured ceilings, timing, cost math,
and a results file that keeps every section's numbers even when a later section fails."""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

PRICE_PER_GPU_HOUR = 3.00  # the seed's nominal H200 price


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": platform.python_version(),
           "torch": torch.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except Exception:  # noqa: BLE001 - optional
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpus=torch.cuda.device_count(), sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def time_cuda(fn, warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of fn() measured with CUDA events after warm-up (host clock on CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def graph_ms(fn, reps: int) -> float:
    """Device milliseconds per fn() from a CUDA graph of `reps` calls (median of 10 replays), after 3
    eager calls on a side stream (Triton JIT, autotuning, the allocator). CUDA only."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    del g
    return sorted(times)[len(times) // 2]


def measure_ceilings(device: str = "cuda", n: int = 1 << 30, m: int = 8192) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and matmul rates on random data, in this run."""
    out = {}
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=20)
    out["copy_GBps"] = 2 * n / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    ms = time_cuda(lambda: a @ b, iters=10)
    out["bf16_TFLOPs"] = 2 * m**3 / (ms * 1e-3) / 1e12
    if device.startswith("cuda"):
        af, bf = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        ms = time_cuda(lambda: torch._scaled_mm(af, bf, one, one, out_dtype=torch.bfloat16), iters=10)
        out["fp8_TFLOPs"] = 2 * m**3 / (ms * 1e-3) / 1e12
    else:
        out["fp8_TFLOPs"] = out["bf16_TFLOPs"]  # no FP8 matmul on the CPU: smoke runs only
    return out


def dollars_per_million(tokens_per_s_per_gpu: float) -> float:
    return PRICE_PER_GPU_HOUR / 3600 / tokens_per_s_per_gpu * 1e6 if tokens_per_s_per_gpu > 0 else float("inf")


@dataclass
class Results:
    path: Path
    data: dict = field(default_factory=dict)

    def section(self, name: str):
        """Context manager: records the section's rows, or its error, and saves after each."""
        res = self

        class _S:
            def __enter__(self):
                self.t0 = time.monotonic()
                res.data.setdefault(name, {"rows": []})
                return res.data[name]

            def __exit__(self, et, e, tb):
                res.data[name]["seconds"] = round(time.monotonic() - self.t0, 1)
                if e is not None:
                    res.data[name]["error"] = "".join(traceback.format_exception(et, e, tb))[-3000:]
                    print(f"[{name}] FAILED: {e}", flush=True)
                res.save()
                return True  # keep going: later sections still run

        return _S()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def out_dir() -> Path:
    return Path(os.environ.get("OUT", "out"))


def markdown_table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def report_rows(name: str, args: dict, copy_gbps: float, rows: list[dict], label) -> Path:
    """A micro-benchmark's rows against the copy rate (keys us, GBps, ratio_copy, speedup): one line each (`label(row)`
    first), the JSON under $OUT/name with the environment and arguments, then the markdown table."""
    for r in rows:
        print(f"{label(r)} {r['us']:8.2f} us  {r['GBps']:6.0f} GB/s ({r['ratio_copy']:.2f} of copy)"
              + (f"  x{r['speedup']:.2f}" if r['speedup'] else ""), flush=True)
    path = out_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": environment(), "args": args, "copy_GBps": copy_gbps, "rows": rows}, indent=1))
    print("\n" + markdown_table(rows, ["what", "variant", "us", "GBps", "ratio_copy", "speedup"]), flush=True)
    print(f"wrote {path}", flush=True)
    return path
