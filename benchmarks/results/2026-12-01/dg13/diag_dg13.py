"""GPU run DG13 (one H200): what the O projection's bias costs in DeepGEMM's K and how to cut it,
at M = 8192, interleaved rounds (every variant once per round, median over rounds) with the SM
clock sampled (diag_dg7.Sampler). Variants:
  rt / ct      N and K runtime (today's launcher) or compiled in (DeepGEMM's own JIT default)
  s4112/s4224  row stride of the augmented K' = 4099 (16-byte vs 128-byte aligned rows)
  full         K' = 4224: the bias block stored whole (zeros), no TMA zero-fill
From FP8 activations, over weight copies that exceed L2. `--build-only` compiles the launchers.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch

from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg

M = 8192
ROUNDS = 7
O_TILES = {"128x192": dl.LARGE_DEFAULT, "256x128": dg.DgConfig(256, 128, mcast=2, mcast_on_a=True)}
QKV_TILE = dl.TILES[(5120, 23)]


def ct(cfg: dg.DgConfig, n: int, k: int) -> dg.DgConfig:
    return dataclasses.replace(cfg, shape_n=n, shape_k=k)


def variants() -> list[tuple[str, str, bool, int, bool, dg.DgConfig]]:
    """(shape, label, bias, row_align, full block, config)."""
    out = []
    for tname, cfg in O_TILES.items():
        out += [("o", f"{tname} no bias rt", False, 16, False, cfg),
                ("o", f"{tname} no bias ct", False, 16, False, ct(cfg, 2880, 4096)),
                ("o", f"{tname} bias s4112 rt", True, 16, False, cfg),
                ("o", f"{tname} bias s4224 rt", True, 128, False, cfg),
                ("o", f"{tname} bias s4224 ct", True, 128, False, ct(cfg, 2880, 4099)),
                ("o", f"{tname} bias full ct", True, 128, True, ct(cfg, 2880, 4224))]
    out += [("qkv", "256x128 pad rt", True, 16, False, QKV_TILE),
            ("qkv", "256x128 pad ct", True, 16, False, ct(QKV_TILE, 5120, 2944)),
            ("qkv", "256x128 no bias rt", False, 16, False, QKV_TILE),
            ("qkv", "256x128 no bias ct", False, 16, False, ct(QKV_TILE, 5120, 2880))]
    return out


def build_only() -> None:
    for *_, cfg in variants():
        t0 = time.time()
        print(cfg, dg.library_path(cfg, 132).name, f"{time.time() - t0:.0f}s", flush=True)


def full_block(aug: dl.AugWeight) -> dl.AugWeight:
    """The bias block stored whole: K' = the row stride (zeros past the bias terms)."""
    w = aug.w.as_strided((aug.w.shape[0], aug.w.stride(0)), (aug.w.stride(0), 1))
    return dl.AugWeight(w, aug.ws, aug.ones)


def main() -> None:
    if "--build-only" in sys.argv:
        build_only()
        return
    from benchmarks.gemm import bench, copies_for
    from kernels import reference as ref
    from scripts.gpu.diag_dg7 import Sampler
    torch.manual_seed(0)
    smi = Sampler()
    shapes = {"qkv": (5120, 2880), "o": (2880, 4096)}
    data = {}
    for name, (n, k) in shapes.items():
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.02)
        b = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        data[name] = (x, w, ws, b, copies_for(w.numel()))
    live = {}
    for shape, label, has_bias, align, full, cfg in variants():
        x, w, ws, b, copies = data[shape]
        n = w.shape[0]
        bb = b if has_bias else None
        augs = [dl.augment_weight(w.clone(), ws.clone(), bb, row_align=align) for _ in range(copies)]
        if full:
            augs = [full_block(g) for g in augs]
        a, xs = dl.augment_activations(x, augs[0])
        y = torch.empty(M, n, dtype=torch.bfloat16, device="cuda")
        try:
            dg.gemm(cfg, a, xs, augs[0].w, augs[0].ws, y)
        except Exception as e:  # noqa: BLE001 - one variant failing must not stop the others
            print(f"{shape} {label}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        want = ref.fp8_linear(x.float(), w, ws, bb, quantize_activations=True)
        err = float((y.float() - want.float()).norm() / want.float().norm())
        calls = [lambda g=g, cfg=cfg, a=a, xs=xs, y=y: dg.gemm(cfg, a, xs, g.w, g.ws, y) for g in augs]
        live[(shape, label)] = (calls, err, f"K'={augs[0].w.shape[1]} stride {augs[0].w.stride(0)}")
    # a compiled-in K must refuse another K (the kernel would otherwise read past the data)
    x, w, ws, b, _ = data["o"]
    aug = dl.augment_weight(w, ws, None)
    a, xs = dl.augment_activations(x[:256], aug)
    try:
        dg.gemm(ct(O_TILES["128x192"], 2880, 4099), a, xs, aug.w, aug.ws, torch.empty(256, 2880, dtype=torch.bfloat16,
                                                                                      device="cuda"))
        print("shape guard: NOT refused (bug)", flush=True)
    except RuntimeError as e:
        print(f"shape guard: refused ({e})", flush=True)
    res = {key: {"ms": [], "mhz": []} for key in live}
    for _ in range(ROUNDS):
        for key, (calls, _, _) in live.items():
            t0 = time.time()
            res[key]["ms"].append(bench(calls, trials=3))
            res[key]["mhz"].append(smi.window(t0, time.time())[0])
            time.sleep(0.2)
    for (shape, label), (_, err, mode) in live.items():
        n, k = shapes[shape]
        r = res[(shape, label)]
        med = statistics.median(r["ms"])
        tf = 2 * M * n * k / 1e9
        print(f"{shape:<3} {label:<24} {mode:<20} err {err:.2e} | median {med * 1e3:6.1f} us {tf / med:5.0f} TFLOP/s "
              f"(rounds {tf / max(r['ms']):.0f}-{tf / min(r['ms']):.0f}) SM {statistics.median(r['mhz']):.0f} MHz",
              flush=True)
    smi.proc.terminate()


if __name__ == "__main__":
    main()
