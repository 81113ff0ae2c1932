"""GPU run DG7 (one H200): where the dense projections' bias goes in DeepGEMM's K (the last block's
padding vs an extra K block vs no bias), at M = 8192, with the SM clock and board power sampled
while each measurement runs (nvidia-smi every 50 ms), so that a spread between runs can be told
apart from a difference between variants. Interleaved rounds (every variant once per round,
median over rounds); "burst" = one replay after 0.5 s idle, "sustained" = benchmarks.gemm.bench
(3 trials of >= 20 ms). From FP8 activations, over weight copies that exceed L2.
`--build-only` compiles the launchers this run and the DeepGEMM tests need (CPU machine)."""
from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

import torch

from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg
from kernels import moe_dg

SHAPES = {"qkv": (5120, 2880), "o": (2880, 4096)}
VARIANTS = [("bias in pad", True, True), ("bias as extra K block", True, False), ("no bias", False, True)]
ROUNDS = 7
M = 8192


class Sampler:
    """nvidia-smi in the background: (host time, SM MHz, watts) every 50 ms."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                      "-lms", "50"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(v) for v in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.time(), mhz, watts))

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        inside = [(c, p) for t, c, p in self.samples if t0 <= t <= t1 + 0.06]
        if not inside:
            return float("nan"), float("nan")
        return statistics.median(c for c, _ in inside), statistics.median(p for _, p in inside)


def build_only() -> None:
    cfgs = {*dl.TILES.values(), dl.LARGE_DEFAULT, dl.SMALL, moe_dg.GATE_UP, moe_dg.DOWN}
    for cfg in cfgs:
        print(cfg, dg.library_path(cfg, 132), flush=True)


def main() -> None:
    if "--build-only" in sys.argv:
        build_only()
        return
    from benchmarks.gemm import bench, copies_for
    from kernels import reference as ref
    torch.manual_seed(0)
    smi = Sampler()
    lin = dl.DeepGemmLinear()
    for name, (n, k) in SHAPES.items():
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.02)
        b = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        copies = copies_for(w.numel())
        y = torch.empty(M, n, dtype=torch.bfloat16, device="cuda")
        live = {}
        for label, has_bias, pad in VARIANTS:
            if name == "o" and has_bias and not pad:
                continue  # K = 4096 has no padding: "pad" already falls back to the extra block
            bb = b if has_bias else None
            augs = [dl.augment_weight(w.clone(), ws.clone(), bb, pad=pad) for _ in range(copies)]
            a, xs = dl.augment_activations(x, augs[0])
            cfg = lin.config_for(M, n, augs[0].ws.shape[1])
            dg.gemm(cfg, a, xs, augs[0].w, augs[0].ws, y)
            want = ref.fp8_linear(x.float(), w, ws, bb, quantize_activations=True)
            err = float((y.float() - want.float()).norm() / want.float().norm())
            calls = [lambda g=g, cfg=cfg, a=a, xs=xs: dg.gemm(cfg, a, xs, g.w, g.ws, y) for g in augs]
            live[label] = (calls, err, f"{cfg.block_m}x{cfg.block_n} K'={augs[0].w.shape[1]} KB'={augs[0].ws.shape[1]}")
        flops = 2 * M * n * k
        res: dict[str, dict[str, list[float]]] = {v: {"ms": [], "mhz": [], "w": [], "burst": [], "burst_mhz": []}
                                                  for v in live}
        for _ in range(ROUNDS):
            for label, (calls, _, _) in live.items():
                r = res[label]
                t0 = time.time()
                r["ms"].append(bench(calls, trials=3))
                mhz, watts = smi.window(t0, time.time())
                r["mhz"].append(mhz)
                r["w"].append(watts)
                time.sleep(0.5)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.time()
                calls[0]()  # keeps the GPU busy while the host enqueues the timed ones
                s.record()
                for c in calls[1:]:
                    c()
                e.record()
                torch.cuda.synchronize()
                r["burst"].append(s.elapsed_time(e) / (len(calls) - 1))
                r["burst_mhz"].append(smi.window(t0, time.time())[0])
        for label, (calls, err, mode) in live.items():
            r = res[label]
            med = statistics.median(r["ms"])
            burst = statistics.median(r["burst"])
            print(f"{name} {label:<22} {mode:<24} err {err:.2e} | sustained median {med * 1e3:6.1f} us "
                  f"{flops / med / 1e9:5.0f} TFLOP/s (rounds {min(r['ms']) * 1e3:.1f}-{max(r['ms']) * 1e3:.1f} us) "
                  f"SM {statistics.median(r['mhz']):.0f} MHz {statistics.median(r['w']):.0f} W | burst median "
                  f"{burst * 1e3:6.1f} us {flops / burst / 1e9:5.0f} TFLOP/s SM {statistics.median(r['burst_mhz']):.0f} MHz",
                  flush=True)
            for i, (ms, mhz) in enumerate(zip(r["ms"], r["mhz"])):
                print(f"    round {i}: {ms * 1e3:6.1f} us {flops / ms / 1e9:5.0f} TFLOP/s at {mhz:.0f} MHz", flush=True)
    smi.proc.terminate()


if __name__ == "__main__":
    main()
