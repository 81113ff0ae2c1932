"""Microbenchmark of each fused kernel (kernels.registry.Fusion) against the unfused launches it
replaces, at gpt-oss-20b dims: 1 token (batch-1 decode), 64 (batch-64 decode) and 8192 (prefill).

Each variant is captured in a CUDA graph as REPS back-to-back repetitions and replayed, so a figure
is device time per call including the gaps between dependent kernels, as in the decode worker's
graph replay (eager timing would measure the host's launch latency instead). Bytes are the
minimum each variant must move (inputs read once, outputs written once); GB/s against the HBM
roofline (4.8 TB/s nominal) and this run's copy bandwidth. At 1 token everything sits in L2 and the
figure that matters is microseconds.

    python -m benchmarks.fusion [--tokens 1,64,8192] [--reps 50]       # writes $OUT/fusion.json

Variant names of the SwiGLU rows: ROWSxWARPS, `tile` = SWIGLU_TILE_EXPERT; every variant's used rows
are checked against the first's bits ("BITS DIFFER" otherwise).

Rows: `norm+router` (add + RMSNorm + router GEMV vs add + RMSNorm then F.linear), `norm+quant` (vs
add + RMSNorm then quantize_act_1x128; up to 64 tokens the fused launch spreads a row's groups over programs,
timed against one program per row too), `norm+router+quant` (up to 64 tokens: the 20b decode layer's MoE
norm with both fusions vs the router fused and a separate quantisation), `rope+store` (q and k RoPE + K/V store, bf16 and e4m3 pages,
vs apply_rope, apply_rope, store_kv), `norm-warps` (the add + RMSNorm kernel at 4/8/16 warps
against the kernel before issue 27: kernels.norm.NUM_WARPS is unmeasured), `swiglu` (the DeepGEMM MoE's SwiGLU + requant pass at
prefill sizes, item 3 of issue 27: its bandwidth today and with kernels.moe_dg.SWIGLU_TILE_EXPERT), `gemv`
(the bf16 attention projections at <= 16 tokens, Fusion.FEW_TOKEN_LINEAR: torch addmm, what runs today, vs
kernels.gemv.few_token_linear's default config and a small sweep; each call reads another copy of W so the
weights stream from HBM as in a decode step, not from L2):

    python -m benchmarks.fusion --tokens 1,4,16 --rows gemv                 # the gemv rows alone

`fp8gemv`: the FP8 projections (--fp8-attention on) at <= 16 tokens: bf16 addmm (the default projections) and
kernels/dense_small.py (Fusion.FEW_TOKEN_FP8) by config:

    python -m benchmarks.fusion --tokens 1,4,16 --rows fp8gemv
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import triton
import triton.language as tl

from benchmarks.common import environment, graph_ms, markdown_table, out_dir

DEV = "cuda"  # a CPU smoke of the call paths sets "cpu" (TRITON_INTERPRET=1) and replaces graph_us
HBM_GBPS = 4800.0
H, E, HQ, HKV, D, PAGE = 2880, 32, 64, 8, 64, 16


def graph_us(fn, reps: int) -> float:
    """Device microseconds per fn() from a CUDA graph of `reps` calls (median of 10 replays)."""
    return graph_ms(fn, reps) * 1e3


def copy_gbps() -> float:
    x = torch.empty(1 << 29, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    us = graph_us(lambda: y.copy_(x), 5)
    return 2 * x.numel() / (us * 1e-6) / 1e9


def _row(what: str, t: int, variant: str, us: float, nbytes: float, copy: float, base_us: float | None) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"what": what, "tokens": t, "variant": variant, "us": us, "bytes": int(nbytes), "GBps": gbps,
            "ratio_hbm": gbps / HBM_GBPS, "ratio_copy": gbps / copy,
            "speedup": (base_us / us) if base_us else None}


@triton.jit
def _main_norm_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, H, eps, stride_x, stride_d, stride_xo, stride_y,
                      BLOCK: tl.constexpr):
    """The add + RMSNorm kernel as it was before issue 27 (one 1-D row block, the weight loaded after
    the reduction): the baseline the new row layout must not lose to."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * stride_d + offs, mask=mask, other=0.0)
    x = (x + d).to(x_ptr.dtype.element_ty)
    tl.store(xo_ptr + row * stride_xo + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w * (xf * tl.rsqrt(var + eps))
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _main_add_norm(x: torch.Tensor, d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xo, y = torch.empty_like(x), torch.empty_like(x)
    _main_norm_kernel[(x.shape[0],)](x, d, w, xo, y, x.shape[1], 1e-5, x.stride(0), d.stride(0), xo.stride(0),
                                     y.stride(0), BLOCK=triton.next_power_of_2(x.shape[1]))
    return y


def _one_program(run):
    """run() with the fused norm's quantisation in one program per row (kernels.norm's shape before spreading)."""
    from kernels import norm
    keep, norm.QUANT_SPREAD_MAX_TOKENS = norm.QUANT_SPREAD_MAX_TOKENS, 0
    try:
        return run()
    finally:
        norm.QUANT_SPREAD_MAX_TOKENS = keep


def norm_rows(t: int, reps: int, copy: float) -> list[dict]:
    from kernels import norm
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.norm import fused_norm

    x = torch.randn(t, H, device=DEV).to(torch.bfloat16)
    d = torch.randn(t, H, device=DEV).to(torch.bfloat16)
    w = torch.rand(H, device=DEV) + 0.5
    kb = -(-H // 128)
    base = 4 * t * H * 2 + H * 4  # x, delta in; x + delta, y out; the fp32 weight
    rows = []
    for e in (E, 4 * E) if t <= 64 else ():  # 20b's 32 experts, 120b's 128; the fusion serves <= 64 tokens
        rw = (torch.randn(e, H, device=DEV) * 0.02).to(torch.bfloat16)
        rb = torch.randn(e, device=DEV).to(torch.bfloat16)
        un = graph_us(lambda: torch.nn.functional.linear(fused_norm(x, d, w, 1e-5).y, rw, rb), reps)
        fu = graph_us(lambda: fused_norm(x, d, w, 1e-5, router=(rw, rb)), reps)
        nb = base + e * H * 2 + e * 2 + t * e * 2
        rows += [_row(f"norm+router E{e}", t, "unfused", un, nb + t * H * 2, copy, None),  # + y read by the GEMM
                 _row(f"norm+router E{e}", t, "fused", fu, nb, copy, un)]
    un = graph_us(lambda: quantize_act_1x128(fused_norm(x, d, w, 1e-5).y), reps)
    spread = t <= norm.QUANT_SPREAD_MAX_TOKENS

    def fused(what: str, nbytes: float, base_us: float, **kw) -> list[dict]:
        """The fused launch, and up to QUANT_SPREAD_MAX_TOKENS the same launch with one program quantising each
        row (the shape before the spread) too."""
        run = lambda: graph_us(lambda: fused_norm(x, d, w, 1e-5, quant=True, **kw), reps)  # noqa: E731
        out = [_row(what, t, "fused spread" if spread else "fused", run(), nbytes, copy, base_us)]
        return out + ([_row(what, t, "fused one program", _one_program(run), nbytes, copy, base_us)] if spread else [])

    nb = base + t * H + t * kb * 4
    rows += [_row("norm+quant", t, "unfused", un, nb + t * H * 2, copy, None), *fused("norm+quant", nb, un)]
    if spread:
        rw = (torch.randn(E, H, device=DEV) * 0.02).to(torch.bfloat16)  # the 20b decode layer's norm: all three
        rb = torch.randn(E, device=DEV).to(torch.bfloat16)
        un = graph_us(lambda: quantize_act_1x128(fused_norm(x, d, w, 1e-5, router=(rw, rb)).y), reps)
        nb += E * H * 2 + E * 2 + t * E * 2
        rows += [_row(f"norm+router+quant E{E}", t, "router fused, quant apart", un, nb + t * H * 2, copy, None),
                 *fused(f"norm+router+quant E{E}", nb, un, router=(rw, rb))]
    ref = graph_us(lambda: _main_add_norm(x, d, w), reps)
    rows.append(_row("norm-warps", t, "before (1-D)", ref, base, copy, None))
    for nw in (4, 8, 16):
        us = graph_us(lambda: fused_norm(x, d, w, 1e-5, num_warps=nw), reps)
        rows.append(_row("norm-warps", t, f"{nw} warps", us, base, copy, ref))
    return rows


def rope_rows(t: int, reps: int, copy: float) -> list[dict]:
    from kernels.triton_store_kv import apply_rope, rope_qk_store_kv, store_kv

    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV).to(torch.bfloat16)
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    cos, sin = torch.rand(t, D // 2, device=DEV), torch.rand(t, D // 2, device=DEV)
    pages = -(-t // PAGE) + 1
    slots = torch.randperm(pages * PAGE, device=DEV)[:t]
    rows = []
    for kv in ("bf16", "fp8"):
        dt = torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16
        kc = torch.zeros(pages, HKV, PAGE, D, device=DEV, dtype=dt)
        vc = torch.zeros_like(kc)
        sc = (torch.ones(HKV, device=DEV), torch.ones(HKV, device=DEV)) if kv == "fp8" else None

        def unfused():
            qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            store_kv(kr, v, kc, vc, slots, sc)
            return qr

        un = graph_us(unfused, reps)
        fu = graph_us(lambda: rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, sc), reps)
        nb = t * (HQ + 2 * HKV) * D * 2 + t * HQ * D * 2 + t * 2 * HKV * D * kc.element_size() + t * D * 4 + t * 8
        rows += [_row(f"rope+store {kv}", t, "unfused", un, nb + 2 * t * HKV * D * 2, copy, None),  # + k_rot out/in
                 _row(f"rope+store {kv}", t, "fused", fu, nb, copy, un)]
        if kv == "fp8":  # tokens per K program (kernels.triton_store_kv.QUANT_BLOCK_T is the default)
            for bt in (1, 2, 4, 16):
                us = graph_us(lambda bt=bt: rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, sc, block_tk=bt), reps)
                rows.append(_row(f"rope+store {kv}", t, f"fused bt={bt}", us, nb, copy, un))
    return rows


def swiglu_rows(t: int, reps: int, copy: float) -> list[dict]:
    """The DeepGEMM MoE's SwiGLU + 1x128 requant pass over a layer-shaped buffer (T * 4 routed rows,
    about half a tile of padding per expert, the capacity's tail tiles unused): what it streams today
    (issue 27: 2.3 TB/s), by tile settings, and with SWIGLU_TILE_EXPERT (one b1 row per program,
    unused tiles skipped). Bytes: the used rows' h read and act + scales written."""
    from kernels import moe_dg
    from kernels.reference import BLOCK, FP8_MAX

    inter, e, bm = 2880, 32, moe_dg.BLOCK_M
    used = -(-(t * 4 + e * bm // 2) // bm) * bm
    rows_ = -(-(t * 4 + e * (bm - 1)) // bm) * bm  # the grouping's capacity
    h = torch.randn(rows_, 2 * inter, device=DEV).to(torch.bfloat16)
    b1 = torch.randn(e, 2 * inter, device=DEV).to(torch.bfloat16)
    layout = (torch.arange(rows_, device=DEV, dtype=torch.int32) // bm) % e
    layout[used:] = -1
    act = torch.empty(rows_, inter, device=DEV, dtype=torch.float8_e4m3fn)
    kb2 = -(-inter // BLOCK)
    acts = torch.empty(kb2, rows_, device=DEV)

    def run(r: int, nw: int, tile: bool) -> None:
        moe_dg._swiglu_quant_kernel[(rows_ // r, kb2)](h, b1, layout, act, acts, inter, 1.702, 7.0, h.stride(0),
                                                      b1.stride(0), act.stride(0), acts.stride(0), ROWS=r,
                                                      GROUP=BLOCK, FP8_MAX_C=FP8_MAX, HW_CVT=h.is_cuda,
                                                      TILE_EXPERT=tile, num_warps=nw)

    nb = used * (2 * inter * 2 + inter + kb2 * 4)
    out, ref, bits = [], None, None
    for r, nw, tile in ((moe_dg.SWIGLU_ROWS, moe_dg.SWIGLU_WARPS, False), (moe_dg.SWIGLU_ROWS, moe_dg.SWIGLU_WARPS, True),
                        (8, 4, True), (16, 8, True), (32, 8, True), (32, 4, True)):
        run(r, nw, tile)
        got = (act[:used].view(torch.uint8).clone(), acts[:, :used].clone())
        bits = bits or got
        same = torch.equal(got[0], bits[0]) and torch.equal(got[1], bits[1])
        us = graph_us(lambda: run(r, nw, tile), max(1, reps // 10))
        ref = ref or us
        out.append(_row("swiglu", t, f"{r}x{nw}{' tile' if tile else ''}{'' if same else ' BITS DIFFER'}", us, nb,
                        copy, ref))
    return out


# A small sweep around kernels.gemv.DEFAULT_CONFIG (the first): split target, tile shape, pipeline depth of the MMA
# path (rows_t1 = 0: at one token these would otherwise all run the whole-rows kernel), and at one token the
# whole-rows kernel's own knobs: rows per program, K step, warps, stages.
def _gemv_sweep(t: int):
    from kernels.gemv import GemvConfig

    mma = (GemvConfig(waves=8), GemvConfig(waves=2), GemvConfig(block_n=128, num_warps=8), GemvConfig(block_n=32),
           GemvConfig(block_k=256, num_stages=3), GemvConfig(block_k=64, num_stages=6), GemvConfig(num_stages=6),
           GemvConfig(num_warps=8))
    if t != 1:
        return (GemvConfig(), *mma)
    rows = (GemvConfig(rows_t1=4), GemvConfig(rows_t1=16), GemvConfig(rows_t1=32, num_warps=8),
            GemvConfig(block_k_t1=256), GemvConfig(block_k_t1=1024), GemvConfig(rows_t1=16, block_k_t1=256),
            GemvConfig(num_stages=2), GemvConfig(num_warps=8))
    return (GemvConfig(), GemvConfig(rows_t1=0), *(dataclasses.replace(c, rows_t1=0) for c in mma), *rows)


def gemv_rows(t: int, reps: int, copy: float) -> list[dict]:
    """20b's QKV [5120, 2880] and O [2880, 4096] with bias at t tokens. Bytes: W, x, bias read, y written
    (the split's fp32 partials stay in L2 and are not counted). A variant off the fp32 reference by more
    than one rounding is marked WRONG."""
    from kernels.gemv import DEFAULT_CONFIG, few_token_linear, num_sms, split_k

    rows = []
    for what, n, k in (("qkv", (HQ + 2 * HKV) * D, H), ("o", H, HQ * D)):
        copies = -(-(256 << 20) // (n * k * 2))  # > 5x the 50 MB L2: each call's W comes from HBM
        ws = [(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        x = torch.randn(t, k, device=DEV).to(torch.bfloat16)
        ref = x.float() @ ws[0].float().T + b.float()
        nb = n * k * 2 + t * k * 2 + n * 2 + t * n * 2

        def cycling(fn):
            it = iter(range(1 << 62))
            return lambda: fn(ws[next(it) % copies])

        base = graph_us(cycling(lambda w: torch.nn.functional.linear(x, w, b)), reps)
        rows.append(_row(f"gemv {what}", t, "addmm", base, nb, copy, None))
        for cfg in _gemv_sweep(t):
            s, _ = split_k(n, k, cfg, num_sms(x.device))
            ok = torch.allclose(few_token_linear(x, ws[0], b, cfg).float(), ref, rtol=2 ** -8, atol=1e-4)
            us = graph_us(cycling(lambda w, cfg=cfg: few_token_linear(x, w, b, cfg)), reps)
            rows_kernel = t == 1 and cfg.rows_t1 > 0
            tiles = f"rows{cfg.rows_t1}x{cfg.block_k_t1}" if rows_kernel else f"{cfg.block_n}x{cfg.block_k}"
            name = (f"{'default ' if cfg == DEFAULT_CONFIG else ''}{tiles} w{cfg.num_warps} st{cfg.num_stages}"
                    f"{'' if rows_kernel else f' S{s}'}{'' if ok else ' WRONG'}")
            rows.append(_row(f"gemv {what}", t, name, us, nb, copy, base))
        del ws
    return rows


def _fp8_sweep():
    from kernels.dense_small import DenseSmallConfig

    return (DenseSmallConfig(), DenseSmallConfig(block_n=128), DenseSmallConfig(ctas_per_sm=2),
            DenseSmallConfig(ctas_per_sm=4), DenseSmallConfig(num_stages=4), DenseSmallConfig(num_stages=2),
            DenseSmallConfig(pdl=True), DenseSmallConfig(tma=False), DenseSmallConfig(block_n=128, ctas_per_sm=2))


def fp8gemv_rows(t: int, reps: int, copy: float) -> list[dict]:
    """20b's QKV and O with bias at t tokens: bf16 addmm (the workers' default projections) and
    kernels/dense_small.py (Fusion.FEW_TOKEN_FP8) by config. (The DeepGEMM FP8 linear, which --fp8-attention on
    takes today, failed CUDA-graph capture here on raw weights (fp8-gemv-ab-1); the model A/B times it.) Each call reads another copy of W (from HBM, as in a decode step). Bytes: each variant's own
    W, x, bias read and y written; the speedup is against addmm. A config off the reference is marked WRONG."""
    from kernels import reference as ref
    from kernels.dense_small import FewTokenFp8Linear, _num_sms, choose_split
    rows = []
    for what, n, k in (("qkv", (HQ + 2 * HKV) * D, H), ("o", H, HQ * D)):
        copies = -(-(256 << 20) // (n * k))  # > 5x the 50 MB L2 in FP8 (bf16 copies: twice that)
        wq = [ref.quantize_fp8_blockwise(torch.randn(n, k, device=DEV) * k ** -0.5) for _ in range(copies)]
        wb = [(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16) for _ in range(copies // 2 + 1)]
        b = torch.randn(n, device=DEV).to(torch.bfloat16)
        x = torch.randn(t, k, device=DEV).to(torch.bfloat16)
        want = ref.fp8_linear(x.float(), *wq[0], b, quantize_activations=True)
        io = t * k * 2 + n * 2 + t * n * 2

        def cycling(ws, fn):
            it = iter(range(1 << 62))
            return lambda: fn(ws[next(it) % len(ws)])

        base = graph_us(cycling(wb, lambda w: torch.nn.functional.linear(x, w, b)), reps)
        rows.append(_row(f"fp8gemv {what}", t, "bf16 addmm", base, n * k * 2 + io, copy, None))
        for cfg in _fp8_sweep():
            lin = FewTokenFp8Linear(cfg)
            ok = torch.allclose(lin(x, *wq[0], b).float(), want, rtol=2 ** -7, atol=1e-3)
            s = choose_split(t * -(-n // cfg.block_n), k, _num_sms(x.device), cfg.ctas_per_sm, cfg.split_k)
            us = graph_us(cycling(wq, lambda w, lin=lin: lin(x, w[0], w[1], b)), reps)
            name = (f"dense_small {cfg.block_n}{' tma' if cfg.tma else ''} c{cfg.ctas_per_sm} st{cfg.num_stages}"
                    f"{' pdl' if cfg.pdl else ''} S{s}{'' if ok else ' WRONG'}")
            rows.append(_row(f"fp8gemv {what}", t, name, us, n * k + io, copy, base))
        del wq, wb
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,64,8192")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rows", default="norm,rope,swiglu", help="which rows, comma-separated: norm, rope, swiglu "
                                                             "(>= 4096 tokens), gemv and fp8gemv (<= 16 tokens; opt-in)")
    a = ap.parse_args()
    kinds = set(a.rows.split(","))
    copy = copy_gbps()
    print(f"copy {copy:.0f} GB/s (bytes read + written)", flush=True)
    rows = []
    for t in [int(x) for x in a.tokens.split(",")]:
        reps = a.reps if t <= 64 else max(2, a.reps // 10)
        fns = [fn for kind, fn in (("norm", norm_rows), ("rope", rope_rows)) if kind in kinds]
        if "gemv" in kinds and t <= 16:
            fns.append(gemv_rows)
        if "fp8gemv" in kinds and t <= 16:
            fns.append(fp8gemv_rows)
        for fn in fns:
            got = fn(t, reps, copy)
            rows += got
            for r in got:
                print(f"{r['what']:<16} T={t:<5} {r['variant']:<28} {r['us']:8.2f} us  {r['GBps']:7.0f} GB/s "
                      f"({r['ratio_hbm']:.0%} of HBM)" + (f"  x{r['speedup']:.2f}" if r['speedup'] else ""), flush=True)
        if t >= 4096 and "swiglu" in kinds:
            got = swiglu_rows(t, reps, copy)
            rows += got
            for r in got:
                print(f"{r['what']:<16} T={t:<5} {r['variant']:<18} {r['us']:8.1f} us  {r['GBps']:7.0f} GB/s "
                      f"({r['ratio_hbm']:.0%} of HBM)", flush=True)
    path = out_dir() / "fusion.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": environment(), "args": vars(a), "copy_GBps": copy, "rows": rows}, indent=1))
    print("\n" + markdown_table(rows, ["what", "tokens", "variant", "us", "GBps", "ratio_hbm", "speedup"]), flush=True)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
