"""The one-token FP8 projections (issue 27) against what one-token steps run today, at gpt-oss-20b widths (QKV:
5,120 x 2,880, O: 2,880 x 4,096, with bias), each captured in a CUDA graph of REPS calls with its weights streamed
from HBM (every call reads another weight copy: nothing left in L2 by the call before): bf16 on kernels/gemv.py's
whole-rows kernel (the default), FP8 on kernels/dense_small.py (Fusion.FEW_TOKEN_FP8, x quantised in the launch),
FP8 on kernels/fp8_rows.py (Fusion.FP8_ROWS, W8A16) by config. (rows-b1-ab-1 also timed a one-token MoE on the rows
kernels, at da4b902: it lost to kernels/moe_small.py at every config and was removed.)

Bytes are each variant's weights (and scales) read; GB/s against this run's copy rate. Every FP8-rows row is
checked against its fp32 reference (x unquantised); a config off it is marked WRONG.

    python -m benchmarks.rows_b1 [--reps 50] [--no-sweep]      # writes $OUT/rows_b1.json
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import report_rows
from benchmarks.fusion import copy_gbps, graph_us

DEV = "cuda"  # module constants, so a CPU smoke (tests/kernels/test_fp8_rows.py) can shrink them
H, HQ, HKV, D = 2880, 64, 8, 64
STREAM_BYTES = 512 << 20  # FP8 weight copies per projection: > 10x the 50 MB L2


def _row(what: str, variant: str, us: float, nbytes: float, copy: float, base: float | None, ok: bool = True) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"what": what, "variant": variant + ("" if ok else " WRONG"), "us": us, "bytes": int(nbytes),
            "GBps": gbps, "ratio_copy": gbps / copy, "speedup": base / us if base else None}


def _cycling(items, fn):
    it = iter(range(1 << 62))
    return lambda: fn(items[next(it) % len(items)])


def _rows_configs(sweep: bool):
    from kernels.fp8_rows import RowsConfig

    cfgs = [None, RowsConfig()]  # None: fp8_rows.config_for(K), the model's; then 8 x 512
    if sweep:
        cfgs += [RowsConfig(block_n=4, block_k=1024), RowsConfig(block_n=4, block_k=512),
                 RowsConfig(block_n=4, block_k=2048), RowsConfig(block_n=2, block_k=512), RowsConfig(block_k=1024),
                 RowsConfig(num_warps=8), RowsConfig(num_stages=4), RowsConfig(pdl=False)]
    return cfgs


def projection_rows(reps: int, copy: float, sweep: bool) -> list[dict]:
    from kernels import reference as ref
    from kernels.dense_small import few_token_fp8_linear
    from kernels.fp8_rows import config_for, fp8_rows_linear
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
        base = graph_us(_cycling(wb, lambda w: few_token_linear(x, w, b)), reps)
        rows.append(_row(what, "bf16 gemv rows (default)", base, n * k * 2, copy, None))
        us = graph_us(_cycling(wq, lambda w: few_token_fp8_linear(x, w[0], w[1], b)), reps)
        rows.append(_row(what, "fp8 dense_small (fp8_gemv)", us, n * k + scale_bytes, copy, base))
        for cfg in _rows_configs(sweep):
            ok = torch.allclose(fp8_rows_linear(x, *wq[0], b, cfg).float(), want, rtol=2 ** -7, atol=1e-2)
            us = graph_us(_cycling(wq, lambda w, cfg=cfg: fp8_rows_linear(x, w[0], w[1], b, cfg)), reps)
            c = cfg or config_for(k)
            name = (f"fp8 rows {'by K ' if cfg is None else ''}{c.block_n}x{c.block_k} "
                    f"w{c.num_warps} s{c.num_stages}{' pdl' if c.pdl else ''}")
            rows.append(_row(what, name, us, n * k + scale_bytes, copy, base, ok))
        del wq, wb
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-sweep", action="store_true", help="the default configs only")
    a = ap.parse_args()
    copy = copy_gbps()
    print(f"copy {copy:.0f} GB/s (bytes read + written)", flush=True)
    rows = projection_rows(a.reps, copy, not a.no_sweep)
    report_rows("rows_b1.json", vars(a), copy, rows, lambda r: f"{r['what']:<8} {r['variant']:<48}")

if __name__ == "__main__":
    main()
