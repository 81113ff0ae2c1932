"""The one-token W8A16 kernels (issue 27) against what one-token steps run today, at gpt-oss-20b widths, each
captured in a CUDA graph of REPS calls with its weights streamed from HBM (every call reads another weight copy
or another expert set: nothing left in L2 by the call before):

  * projections (QKV: 5,120 x 2,880, O: 2,880 x 4,096, with bias): bf16 on kernels/gemv.py's whole-rows kernel
    (the default), FP8 on kernels/dense_small.py (Fusion.FEW_TOKEN_FP8, x quantised in the launch), FP8 on
    kernels/fp8_rows.py (Fusion.FP8_ROWS) by config;
  * the MoE layer (32 experts, top 4, one token): kernels/moe_small.py with x already quantised (the default:
    the norm quantises it, a cost not counted here) and without, and kernels/moe_rows.py (Fusion.MOE_ROWS) by
    config.

Bytes are each variant's weights (and scales) read; GB/s against this run's copy rate. Every FP8-rows row is
checked against its fp32 reference (x unquantised); a config off it is marked WRONG.

    python -m benchmarks.rows_b1 [--reps 50] [--no-sweep]      # writes $OUT/rows_b1.json
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import environment, graph_ms, markdown_table, out_dir

DEV = "cuda"  # module constants, so a CPU smoke (tests/kernels/test_fp8_rows.py) can shrink them
H, HQ, HKV, D, E, TOP_K = 2880, 64, 8, 64, 32, 4
STREAM_BYTES = 512 << 20  # FP8 weight copies per projection: > 10x the 50 MB L2


def _us(fn, reps: int) -> float:
    return graph_ms(fn, reps) * 1e3


def copy_gbps() -> float:
    x = torch.empty(1 << 29, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    return 2 * x.numel() / (_us(lambda: y.copy_(x), 5) * 1e-6) / 1e9


def _row(what: str, variant: str, us: float, nbytes: float, copy: float, base: float | None, ok: bool = True) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"what": what, "variant": variant + ("" if ok else " WRONG"), "us": us, "bytes": int(nbytes),
            "GBps": gbps, "ratio_copy": gbps / copy, "speedup": base / us if base else None}


def _cycling(items, fn):
    it = iter(range(1 << 62))
    return lambda: fn(items[next(it) % len(items)])


def _rows_configs(sweep: bool):
    from kernels.fp8_rows import RowsConfig

    cfgs = [RowsConfig()]
    if sweep:
        cfgs += [RowsConfig(unroll=4), RowsConfig(unroll=4, num_stages=4), RowsConfig(num_warps=8),
                 RowsConfig(block_n=4, unroll=8), RowsConfig(block_k=512, num_stages=4), RowsConfig(block_k=512),
                 RowsConfig(block_k=1024, num_stages=4), RowsConfig(block_k=1024, num_stages=2),
                 RowsConfig(block_n=4, block_k=1024, num_stages=4), RowsConfig(block_k=512, num_stages=4, pdl=False)]
    return cfgs


def projection_rows(reps: int, copy: float, sweep: bool) -> list[dict]:
    from kernels import reference as ref
    from kernels.dense_small import few_token_fp8_linear
    from kernels.fp8_rows import fp8_rows_linear
    from kernels.gemv import few_token_linear

    rows = []
    for what, n, k in (("qkv", (HQ + 2 * HKV) * D, H), ("o", H, HQ * D)):
        copies = -(-STREAM_BYTES // (n * k))  # FP8 copies (bf16: twice the bytes)
        wq = [ref.quantize_fp8_blockwise(torch.randn(n, k, device=DEV) * k ** -0.5) for _ in range(copies)]
        wb = [(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16) for _ in range(copies // 2 + 1)]
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        x = torch.randn(1, k, device=DEV).to(torch.bfloat16)
        want = ref.fp8_linear(x.float(), *wq[0], b.float(), quantize_activations=False)
        scale_bytes = wq[0][1].numel() * 4
        base = _us(_cycling(wb, lambda w: few_token_linear(x, w, b)), reps)
        rows.append(_row(what, "bf16 gemv rows (default)", base, n * k * 2, copy, None))
        us = _us(_cycling(wq, lambda w: few_token_fp8_linear(x, w[0], w[1], b)), reps)
        rows.append(_row(what, "fp8 dense_small (fp8_gemv)", us, n * k + scale_bytes, copy, base))
        for cfg in _rows_configs(sweep):
            ok = torch.allclose(fp8_rows_linear(x, *wq[0], b, cfg).float(), want, rtol=2 ** -7, atol=1e-2)
            us = _us(_cycling(wq, lambda w, cfg=cfg: fp8_rows_linear(x, w[0], w[1], b, cfg)), reps)
            name = (f"fp8 rows {cfg.block_n}x{cfg.block_k} u{cfg.unroll if cfg.block_k == 128 else '-'} w{cfg.num_warps} "
                    f"s{cfg.num_stages}{' pdl' if cfg.pdl else ''}")
            rows.append(_row(what, name, us, n * k + scale_bytes, copy, base, ok))
        del wq, wb
    return rows


def _moe_configs(sweep: bool):
    from kernels.moe_rows import MoERowsConfig

    cfgs = [MoERowsConfig()]
    if sweep:
        cfgs += [MoERowsConfig(unroll1=1, unroll2=1), MoERowsConfig(unroll1=4, unroll2=8), MoERowsConfig(unroll2=2),
                 MoERowsConfig(block_n1=8), MoERowsConfig(block_n1=32, unroll1=4), MoERowsConfig(warps1=8),
                 MoERowsConfig(block_n2=4), MoERowsConfig(block_n2=16), MoERowsConfig(warps2=4),
                 MoERowsConfig(pdl=False)]
    return cfgs


def w8a16_reference(x: torch.Tensor, logits: torch.Tensor, top_k: int, w) -> torch.Tensor:
    """The MoE in fp32 on the dequantised experts, x and act unquantised (what kernels/moe_rows.py computes)."""
    import dataclasses

    from kernels.torch_backend import TorchMoE

    w32 = dataclasses.replace(w, b1=w.b1.float(), b2=None if w.b2 is None else w.b2.float())
    return TorchMoE()(x.float(), logits.float(), top_k, w32)


def moe_rows_section(reps: int, copy: float, sweep: bool) -> list[dict]:
    import benchmarks.moe as bm
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.moe_rows import moe_rows
    from kernels.moe_small import SmallBatchMoE

    w, _ = bm.make_experts(E, seed=0)  # bm.H x bm.I (gpt-oss: 2880 x 2880)
    gen = torch.Generator(device=DEV).manual_seed(1)
    sets = bm.logit_sets(1, E, gen)  # 8 disjoint 4-expert sets
    x = torch.randn(1, bm.H, device=DEV).to(torch.bfloat16)
    xq = quantize_act_1x128(x)
    nbytes = bm.weight_bytes_read(w, sets)
    want = w8a16_reference(x, sets[0], TOP_K, w)
    small = SmallBatchMoE()
    rows = []
    base = _us(_cycling(sets, lambda lg: small(x, lg, TOP_K, w, xq)), reps)
    rows.append(_row("moe 20b", "moe_small, x quantised by the norm (default)", base, nbytes, copy, None))
    us = _us(_cycling(sets, lambda lg: small(x, lg, TOP_K, w)), reps)
    rows.append(_row("moe 20b", "moe_small, quantising x", us, nbytes, copy, base))
    for cfg in _moe_configs(sweep):
        got = moe_rows(x, sets[0], TOP_K, w, cfg).float()
        ok = float((got - want).norm() / want.norm()) < 2e-2  # bf16 rounding points (the interpreter truncates)
        us = _us(_cycling(sets, lambda lg, cfg=cfg: moe_rows(x, lg, TOP_K, w, cfg)), reps)
        name = (f"moe_rows {cfg.block_n1}x128 u{cfg.unroll1} w{cfg.warps1} / {cfg.block_n2}x128 "
                f"u{cfg.unroll2} w{cfg.warps2}{' pdl' if cfg.pdl else ''}")
        rows.append(_row("moe 20b", name, us, nbytes, copy, base, ok))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-sweep", action="store_true", help="the default configs only")
    a = ap.parse_args()
    copy = copy_gbps()
    print(f"copy {copy:.0f} GB/s (bytes read + written)", flush=True)
    rows = []
    for section in (projection_rows, moe_rows_section):
        got = section(a.reps, copy, not a.no_sweep)
        rows += got
        for r in got:
            print(f"{r['what']:<8} {r['variant']:<48} {r['us']:8.2f} us  {r['GBps']:6.0f} GB/s "
                  f"({r['ratio_copy']:.2f} of copy)" + (f"  x{r['speedup']:.2f}" if r['speedup'] else ""), flush=True)
    path = out_dir() / "rows_b1.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": environment(), "args": vars(a), "copy_GBps": copy, "rows": rows}, indent=1))
    print("\n" + markdown_table(rows, ["what", "variant", "us", "GBps", "ratio_copy", "speedup"]), flush=True)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
