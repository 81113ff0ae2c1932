"""Dense FP8 block-scaled linear + bias on the H200: every backend against the reference and
against ceilings measured in the same run. Unattended: each section runs in try/except (a failure
is recorded, the rest goes on); prints a table; writes $OUT/gemm.json.

    python -m benchmarks.gemm [--quick] [--clock]

Shapes are gpt-oss attention projections (identical for 20b and 120b): qkv N=5120 K=2880 and
o N=2880 K=4096, M = tokens 1..16k. Backends: scaled_mm (torch._scaled_mm + bias), triton
(kernels.fp8_gemm), deepgemm (DeepGEMM's SM90 kernel, kernels/deepgemm_linear.py), bf16 torch
(F.linear, the unquantised baseline). Timing: CUDA-graph replay of R calls over R distinct
weight/input sets (R chosen so the set exceeds the 60 MiB L2 when the call is bandwidth-bound),
median of 5 trials after warm-up. `--clock`: each row also records the SM clock and board power
nvidia-smi sampled while it was timed (benchmarks/clock.py).
The helpers here (ceilings, bench, Report) are shared by benchmarks/moe.py and tune_moe.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"  # a module constant so a CPU smoke run can swap it
L2_BYTES = 60 * 2**20


@dataclass
class _Clock:
    sampler: object | None = None  # a benchmarks.clock.ClockSampler under --clock
    last: tuple[float, float] = (0.0, 0.0)  # host time span of the last bench()'s timed trials


CLOCK = _Clock()


def clock_fields() -> dict[str, float]:
    """SM clock / power while the last bench() ran its timed trials ({} without --clock)."""
    return CLOCK.sampler.window(*CLOCK.last) if CLOCK.sampler is not None else {}


# ---- shared helpers --------------------------------------------------------------------------
@dataclass
class Report:
    name: str
    data: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.time)

    def section(self, title: str, fn: Callable[[], object]) -> object:
        """Run one section; a failure is recorded and printed, never fatal."""
        start = time.time()
        try:
            out = fn()
            print(f"[{self.name}] {title}: ok ({time.time() - start:.1f}s)", flush=True)
            return out
        except Exception as e:  # noqa: BLE001 - unattended run: record and continue
            msg = f"{title}: {type(e).__name__}: {e}"
            self.errors.append(msg)
            print(f"[{self.name}] FAILED {msg}\n{traceback.format_exc(limit=4)}", flush=True)
            return None

    def write(self) -> Path:
        out_dir = Path(os.environ.get("OUT", "out"))
        out_dir.mkdir(parents=True, exist_ok=True)
        self.data["errors"] = self.errors
        self.data["wall_s"] = round(time.time() - self.t0, 1)
        path = out_dir / f"{self.name}.json"
        path.write_text(json.dumps(self.data, indent=1, default=str))
        print(f"[{self.name}] wrote {path} ({self.data['wall_s']} s, {len(self.errors)} errors)")
        return path


def environment() -> dict:
    import triton
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def bench(calls: list[Callable[[], object]], trials: int = 5, min_ms: float = 20.0) -> float:
    """Median ms per call. All `calls` (distinct buffer sets) are captured into one CUDA graph and
    replayed; falls back to plain launches if capture fails."""
    for c in calls:  # warm-up: compile, autotune, backend probes, allocator
        c()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for c in calls:
                    c()
        torch.cuda.current_stream().wait_stream(stream)
        run = graph.replay
    except Exception:  # noqa: BLE001 - some paths are not capturable; time them eagerly
        torch.cuda.synchronize()

        def run() -> None:
            for c in calls:
                c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3)))
    times = []
    t_host = time.time()
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(calls)))
    CLOCK.last = (t_host, time.time())
    return statistics.median(times)


def copies_for(bytes_per_set: int) -> int:
    """Distinct buffer sets so one graph replay streams > 2x L2 (bandwidth-bound calls)."""
    return max(1, min(16, math.ceil(2 * L2_BYTES / max(bytes_per_set, 1))))


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written) and FP8 block-scaled peak."""
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.reference import quantize_fp8_blockwise
    n = 2**30
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    # Eager, not graph-captured: inside a graph copy_ becomes a memcpy node on the copy engine, which
    # measured 2.7 TB/s on the H200 against 4.2 TB/s for the SM copy kernel the other benchmarks time.
    from benchmarks.common import time_cuda

    ms = time_cuda(lambda: b.copy_(a), warmup=3, iters=20)
    copy_tbs = 2 * n / ms / 1e9
    del a, b
    m = k = nn = 8192
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    w, ws = quantize_fp8_blockwise(torch.randn(nn, k, device=DEVICE) * 0.02)
    xq, xs = quantize_act_1x128(x)
    ms = bench([lambda: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)])
    fp8 = 2 * m * nn * k / ms / 1e9
    wb = torch.randn(nn, k, device=DEVICE, dtype=torch.bfloat16)
    ms = bench([lambda: x @ wb.t()])
    bf16 = 2 * m * nn * k / ms / 1e9
    return {"copy_TBps": round(copy_tbs, 3), "fp8_blockscaled_TFLOPs": round(fp8, 1),
            "bf16_TFLOPs": round(bf16, 1)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def print_table(rows: list[dict], cols: list[str]) -> None:
    print(" | ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" | ".join(f"{_fmt(r.get(c)):>12}" for c in cols))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return "-" if v is None else str(v)


# ---- dense GEMM benchmark --------------------------------------------------------------------
SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
M_VALUES = [1, 16, 128, 1024, 4096, 8192, 16384]


def _backends(rep: Report) -> dict[str, Callable]:
    from kernels.deepgemm_linear import DeepGemmLinear
    from kernels.fp8_gemm import ScaledMMLinear, TritonFp8Linear
    out: dict[str, Callable] = {"scaled_mm": ScaledMMLinear(), "triton": TritonFp8Linear()}

    def load_dg() -> bool:
        from kernels import deepgemm_sm90 as dg
        out["deepgemm"] = DeepGemmLinear()
        rep.data["deepgemm"] = {"loads": True, "headers": str(dg.include_dir()),
                                "how": "sm90_fp8_gemm_1d2d from the wheel's headers, our launcher"}
        return True
    if rep.section("deepgemm headers", load_dg) is None:
        rep.data["deepgemm"] = {"loads": False, "error": rep.errors[-1] if rep.errors else None}
    return out


def run_shape(rep: Report, shape: str, n: int, k: int, m_values: list[int], backends: dict) -> list[dict]:
    from kernels import reference as ref
    ceil = rep.data["ceilings"]
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    w_bf16 = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    w, ws = ref.quantize_fp8_blockwise(w_bf16)
    bias = torch.randn(n, device=DEVICE, generator=gen).to(torch.bfloat16) * 0.1
    sets = copies_for(w.numel())
    ws_sets = [(w, ws, w_bf16)] + [(w.clone(), ws.clone(), w_bf16.clone()) for _ in range(sets - 1)]
    for m in m_values:
        x = torch.randn(m, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        flops = 2 * m * n * k
        check = m <= 4096
        if check:
            truth = x.float() @ w_bf16.float().t() + bias.float()  # unquantised fp32
            want = ref.fp8_linear(x.float(), w, ws, bias, quantize_activations=True)  # fp32
        for name, impl in [*backends.items(), ("bf16_torch", None)]:
            def one() -> dict:
                if impl is None:
                    calls = [lambda wb=wb: F.linear(x, wb, bias) for _, _, wb in ws_sets]
                    nbytes = w_bf16.numel() * 2
                else:
                    calls = [lambda a=a, s=s: impl(x, a, s, bias) for a, s, _ in ws_sets]
                    nbytes = w.numel() + ws.numel() * 4
                nbytes += x.numel() * 2 + m * n * 2
                ms = bench(calls)
                row = {"shape": shape, "M": m, "backend": name, "ms": ms,
                       "TFLOPs": flops / ms / 1e9, "TBps": nbytes / ms / 1e9, **clock_fields()}
                row["pct_fp8_peak"] = 100 * row["TFLOPs"] / ceil["fp8_blockscaled_TFLOPs"]
                row["pct_copy_bw"] = 100 * row["TBps"] / ceil["copy_TBps"]
                if check:
                    y = F.linear(x, w_bf16, bias) if impl is None else impl(x, w, ws, bias)
                    row["err_vs_fp32"] = rel_err(y, truth)  # FP8 (or bf16) vs unquantised fp32
                    if impl is not None:
                        row["err_vs_ref"] = rel_err(y, want)  # vs reference.fp8_linear
                if impl is not None and hasattr(impl, "describe"):
                    row["mode"] = impl.describe(k, x.dtype)
                return row
            r = rep.section(f"{shape} M={m} {name}", one)
            if r is not None:
                rows.append(r)
        if m >= 1024 and "scaled_mm" in backends:
            rows += rep.section(f"{shape} M={m} scaled_mm GEMM only", lambda: _gemm_only_rows(
                rep, backends["scaled_mm"], shape, x, w, ws, bias, ws_sets, flops, ceil)) or []
        if m >= 1024 and "deepgemm" in backends:
            rows += rep.section(f"{shape} M={m} deepgemm GEMM only", lambda: _dg_gemm_only_rows(
                shape, x, w, ws, bias, ws_sets, flops, ceil)) or []
    return rows


def _dg_gemm_only_rows(shape: str, x, w, ws, bias, ws_sets, flops: int, ceil: dict) -> list[dict]:
    """DeepGEMM's kernel from activations already in FP8: bias where DeepGemmLinear puts it (the
    last K block's padding when K leaves room, else an extra K block), the extra block forced, and
    no bias; FLOPs count the real K."""
    from kernels import deepgemm_linear as dl
    from kernels import deepgemm_sm90 as dg
    m, k = x.shape
    n = w.shape[0]
    out = []
    cases = [("deepgemm gemm+bias (fp8 in)", bias, True), ("deepgemm gemm+bias, extra K block (fp8 in)", bias, False),
             ("deepgemm gemm, no bias (fp8 in)", None, True)]
    if k % 128 == 0:  # no padding: the default already is the extra block
        cases.pop(1)
    for label, bb, pad in cases:
        augs = [dl.augment_weight(a, s_, bb, pad=pad) for a, s_, _ in ws_sets]
        a, xs = dl.augment_activations(x, augs[0])
        cfg = dl.config_for(m, n, augs[0].w.shape[1])
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        calls = [lambda g=g: dg.gemm(cfg, a, xs, g.w, g.ws, y) for g in augs]
        ms = bench(calls)
        row = {"shape": shape, "M": m, "backend": label, "ms": ms, "TFLOPs": flops / ms / 1e9,
               "mode": f"{cfg.block_m}x{cfg.block_n} mcast {cfg.mcast}, K={k} -> {augs[0].w.shape[1]} "
                       f"(row stride {augs[0].w.stride(0)}, constant columns {augs[0].ones})", **clock_fields()}
        row["pct_fp8_peak"] = 100 * row["TFLOPs"] / ceil["fp8_blockscaled_TFLOPs"]
        out.append(row)
    return out


def _gemm_only_rows(rep: Report, lin, shape: str, x, w, ws, bias, ws_sets, flops: int, ceil: dict) -> list[dict]:
    """The block-scaled GEMM itself, from activations already in FP8 (what a producer that fuses
    the 1x128 quantisation into its epilogue, e.g. the RMSNorm before QKV, hands over): with the
    bias in cuBLASLt's epilogue and without bias, at the padded K the linear uses. FLOPs count the
    real K."""
    from kernels.fp8_quant import quantize_act_1x128
    m, k = x.shape
    lin(x, w, ws, bias)  # probes K padding and the bias epilogue
    kp = lin._k_pad[k]
    xq, xs = quantize_act_1x128(x, k_pad=kp)
    padded = [lin._padded.get(a, s_, kp) for a, s_, _ in ws_sets]
    b = bias.to(torch.bfloat16)
    out = []
    for label, bb in (("scaled_mm gemm+bias (fp8 in)", b), ("scaled_mm gemm, no bias (fp8 in)", None)):
        calls = [lambda wq=wq, wsq=wsq, bb=bb: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=wsq.t(), bias=bb,
                                                                 out_dtype=torch.bfloat16) for wq, wsq in padded]
        ms = bench(calls)
        row = {"shape": shape, "M": m, "backend": label, "ms": ms, "TFLOPs": flops / ms / 1e9,
               "mode": f"K={k} padded to {kp}", **clock_fields()}
        row["pct_fp8_peak"] = 100 * row["TFLOPs"] / ceil["fp8_blockscaled_TFLOPs"]
        out.append(row)
    qms = bench([lambda: quantize_act_1x128(x, k_pad=kp)])
    out.append({"shape": shape, "M": m, "backend": "act quant 1x128 (triton)", "ms": qms,
                "TBps": (x.numel() * 2 + m * kp) / qms / 1e9})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer M values")
    ap.add_argument("--clock", action="store_true", help="record the SM clock and power per row (nvidia-smi)")
    args = ap.parse_args()
    if args.clock:
        from benchmarks.clock import ClockSampler
        CLOCK.sampler = ClockSampler()
    rep = Report("gemm")
    rep.data["env"] = rep.section("environment", environment)
    rep.data["ceilings"] = rep.section("ceilings", measure_ceilings) or {
        "copy_TBps": 4.08, "fp8_blockscaled_TFLOPs": 1334.0, "bf16_TFLOPs": 767.0, "assumed": True}
    print("ceilings:", rep.data["ceilings"])
    backends = _backends(rep)
    m_values = [1, 128, 8192] if args.quick else M_VALUES
    rows: list[dict] = []
    for shape, (n, k) in SHAPES.items():
        rows += rep.section(f"shape {shape}", lambda: run_shape(rep, shape, n, k, m_values, backends)) or []
    rep.data["rows"] = rows
    targets = {}
    for r in rows:
        if r["M"] == 8192 and "TFLOPs" in r and "no bias" not in r["backend"]:
            targets[f"dense_fp8_bias_M8192_{r['shape']}_{r['backend']}_TFLOPs>=1100"] = r["TFLOPs"] >= 1100
    rep.data["targets"] = targets
    print_table(rows, ["shape", "M", "backend", "ms", "TFLOPs", "pct_fp8_peak", "TBps", "pct_copy_bw",
                       "err_vs_ref", "err_vs_fp32", *(["sm_mhz", "watts"] if CLOCK.sampler else [])])
    if CLOCK.sampler:
        CLOCK.sampler.close()
    modes = {r["backend"] + " " + r["shape"]: r["mode"] for r in rows if "mode" in r}
    print("modes:", json.dumps(modes, indent=0))
    print("targets:", targets)
    rep.write()
    sys.exit(0)


if __name__ == "__main__":
    main()
