"""Where the few-token MoE's batch-1 time goes (issue 27): its kernels against bare weight streams.

issue27-h100-1 (H100): `_gate_up_small_kernel` 33.7 us and `_down_small_kernel` 16.8 us per 20b layer, both ~2.0 TB/s
over the 66 / 33 MB of FP8 weights of 4 experts, where the card copies at ~3.0. Two explanations predict different
fixes: (a) the kernels' own chain (routing and x quantised before the K loop; partials, arrival atomic and the last
CTA's SwiGLU / combine after it) costs a fixed ~5 us: fewer, longer kernels would help; (b) the access pattern
(each CTA reads 128-byte pieces of 128-256 rows 2,880 bytes apart, split over 184-368 CTAs) streams slower than
a copy: a tiled weight layout would help. Timed here, CUDA graphs over 8 disjoint expert sets (nothing in L2):

  kernel        the workers' few-token kernel (SmallBatchMoE, default config), routing + epilogue included
  stream        the same grid, tiles, TMA boxes and stages, each box through the same swapped wgmma against a
                ones column (no routing, no quantisation, no scales, no epilogue): the K loop alone
  stream-tiled  the same loop over a copy of the weights laid out tile by tile ([E, N/BN, K/BK, BN, BK]: every box
                one contiguous 32 KB / 16 KB run)
  loop          gate_up's own K loop (row_gemm_swapped: the x tile and both scales per box), no preamble, no epilogue;
                `+ route` routes the token first, `+ route + quantise` also quantises x over the CTA's K range (the
                kernel's whole start)

and each row's GB/s against the copy bandwidth measured in the same run. stream ~ kernel points at (b), stream ~
copy and kernel slower at (a); stream-tiled says what a tiled layout would buy. Writes $OUT/moe_small_probe.json.

    python -m benchmarks.moe_small_probe
    python -m benchmarks.moe_small_probe --smoke   # the stream kernels' sums on tiny shapes (CPU interpreter)
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from benchmarks.gemm import bench, measure_ceilings  # noqa: E402
from kernels.interface import ExpertWeights  # noqa: E402
from kernels.moe import split_range  # noqa: E402
from kernels.moe_align import topk_softmax_rows  # noqa: E402
from kernels.moe_small import SmallBatchMoE, route_and_quantise_row  # noqa: E402
from kernels.moe_small_tiles import row_gemm_swapped  # noqa: E402

E, H, I, TOP_K = 32, 2880, 2880, 4  # gpt-oss-20b's experts
PREAMBLES = ("", " + route", " + route + quantise")  # _loop_kernel's PREAMBLE
BK = 128


@triton.jit
def _stream_kernel(desc, ids_ptr, out_ptr, N, K, TILED: tl.constexpr, KB: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (pair, N tile, K split) of the few-token kernel's grid: its weight boxes through the swapped wgmma
    (W [BN, BK] x ones [BK, 16]); the row sums go out so nothing is dead code."""
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // SPLIT_K) % num_n
    p = pid // SPLIT_K // num_n
    e = tl.load(ids_ptr + p)
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    ones = tl.full((16, BLOCK_K), 1.0, tl.float32).to(tl.float8e4nv)  # [16, BK], K-major like the kernel's x rows
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if TILED:
            w = tl.reshape(desc.load([(e * num_n + nt) * KB + k0 // BLOCK_K, 0, 0]), (BLOCK_N, BLOCK_K))
        else:
            w = tl.reshape(desc.load([e, nt * BLOCK_N, k0]), (BLOCK_N, BLOCK_K))
        acc += tl.dot(w, tl.trans(ones), out_dtype=tl.float32)
    offs = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, 16)
    tl.store(out_ptr + p * N + offs, tl.sum(tl.where((cols == 0)[None, :], acc, 0.0), axis=1), mask=offs < N)


@triton.jit
def _loop_kernel(logits_ptr, rw_ptr, ids_ptr, x_ptr, xq_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, out_ptr, N, K, E,
                 stride_lt, stride_xt, stride_xqt, stride_xsk, stride_we, stride_wn, stride_wse, stride_wsn,
                 stride_wsk, PREAMBLE: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_TK: tl.constexpr, BLOCK_GX: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr):
    """The gate_up kernel's K loop (row_gemm_swapped: TMA boxes, the x row's e4m3 tile, both scales per block) on
    one token, without its epilogue (the partial goes out as is). PREAMBLE 2: with the kernel's own start (route the
    token, quantise x over the CTA's K range, barrier); 1: routing only; 0: ids and x's e4m3 copy were written
    beforehand."""
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // SPLIT_K) % num_n
    p = pid // SPLIT_K // num_n
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    if PREAMBLE == 2:
        e = route_and_quantise_row(logits_ptr, rw_ptr, ids_ptr, x_ptr, xq_ptr, xs_ptr, 0, p, 0, k_lo, k_hi, E,
                                   stride_lt, stride_xt, stride_xqt, stride_xsk, TOP_K, BLOCK_E, BLOCK_TK, BLOCK_GX,
                                   FP8_MAX_C, HW_CVT)
    elif PREAMBLE == 1:  # routing only: x's e4m3 copy was written beforehand
        rows = tl.arange(0, 1)
        ids, _ = topk_softmax_rows(logits_ptr, rows, rows >= 0, E, stride_lt, TOP_K, BLOCK_E, BLOCK_TK)
        e = tl.sum(tl.sum(tl.where((tl.arange(0, BLOCK_TK) == p)[None, :], ids, 0), axis=1), axis=0)
    else:
        e = tl.load(ids_ptr + p)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    part = row_gemm_swapped(xq_ptr, xs_ptr, stride_xsk, w_ptr + e.to(tl.int64) * stride_we, w_desc, e, nt * BLOCK_N,
                            ws_ptr + e.to(tl.int64) * stride_wse, rn, k_lo, k_hi, stride_wn, stride_wsn, stride_wsk,
                            16, BLOCK_N, BLOCK_K, BLOCK_K, True)
    tl.store(out_ptr + p * N + offs_n, part, mask=offs_n < N)


def loop_calls(experts: ExpertWeights, x: torch.Tensor, logit_sets: list[torch.Tensor], id_sets: list[torch.Tensor],
               split: int, stages: int, preamble: int, out: torch.Tensor | None = None) -> list:
    """gate_up's K loop on one token per expert set (see _loop_kernel); x's e4m3 copy is made once beforehand.
    out [TOP_K, N] fp32 gets the partials (the last store of each element wins; the smoke test runs split 1)."""
    from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128
    from kernels.reference import FP8_MAX
    w, ws = experts.w1, experts.w1_scale
    n, k, e = w.shape[1], w.shape[2], w.shape[0]
    xq, xs = quantize_act_1x128(x)  # [1, K] e4m3, [1, K/128]: one token, so xs's K stride is 1 as in the kernel
    xs_buf = xs.reshape(-1).contiguous()  # [K/128]
    xq_buf = torch.empty(1, k, dtype=FP8_DTYPE, device=x.device).copy_(xq)
    desc = TensorDescriptor.from_tensor(w, [1, cfg_bn(), BK])
    out = torch.empty(TOP_K, n, dtype=torch.float32, device=x.device) if out is None else out
    rw = torch.empty(1, TOP_K, dtype=x.dtype, device=x.device)
    per_split = triton.cdiv(triton.cdiv(k, BK), split)
    grid = (TOP_K * triton.cdiv(n, cfg_bn()) * split,)

    def call(lg: torch.Tensor, ids: torch.Tensor) -> None:
        _loop_kernel[grid](lg, rw, ids, x, xq_buf, xs_buf, w, desc, ws, out, n, k, e, lg.stride(0), x.stride(0),
                           xq_buf.stride(0), 1, w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
                           ws.stride(2), PREAMBLE=preamble, TOP_K=TOP_K, BLOCK_E=triton.next_power_of_2(e),
                           BLOCK_TK=triton.next_power_of_2(TOP_K), BLOCK_GX=triton.next_power_of_2(per_split),
                           SPLIT_K=split, BLOCK_N=cfg_bn(), BLOCK_K=BK, FP8_MAX_C=FP8_MAX, HW_CVT=x.is_cuda,
                           num_warps=4, num_stages=stages)
    return [lambda lg=lg, ids=ids: call(lg, ids) for lg, ids in zip(logit_sets, id_sets)]


def cfg_bn() -> int:
    return SmallBatchMoE.config_for(TOP_K).block_n1


def tiled(w: torch.Tensor, bn: int) -> torch.Tensor:
    """[E, N, K] -> [E * N/bn * KB, bn, BK] (K padded to whole boxes, N to whole tiles): box i is one contiguous run."""
    e, n, k = w.shape
    kb, nb = -(-k // BK), -(-n // bn)
    pad = torch.zeros(e, nb * bn, kb * BK, dtype=torch.uint8, device=w.device)
    pad[:, :n, :k] = w.view(torch.uint8)
    t = pad.view(e, nb, bn, kb, BK).permute(0, 1, 3, 2, 4).contiguous()
    return t.view(e * nb * kb, bn, BK).view(w.dtype)


def stream_calls(w: torch.Tensor, n: int, k: int, id_sets: list[torch.Tensor], bn: int, split: int, stages: int,
                 tiled_w: bool, out: torch.Tensor | None = None) -> list:
    """One call per expert set: w is [E, n, k] or its tiled() copy; out [TOP_K, n] fp32 gets the row sums
    of split 0's range (every split stores: the last store wins; the smoke test runs split 1)."""
    kb = -(-k // BK)
    desc = TensorDescriptor.from_tensor(w, [1, bn, BK])
    out = torch.empty(TOP_K, n, dtype=torch.float32, device=w.device) if out is None else out
    grid = (TOP_K * triton.cdiv(n, bn) * split,)

    def call(ids: torch.Tensor) -> None:
        _stream_kernel[grid](desc, ids, out, n, k, TILED=tiled_w, KB=kb, SPLIT_K=split, BLOCK_N=bn, BLOCK_K=BK,
                             num_warps=4, num_stages=stages)
    return [lambda ids=ids: call(ids) for ids in id_sets]


def smoke() -> None:
    """Both layouts' row sums against torch on tiny experts (K not a whole number of boxes, N of tiles)."""
    e, n, k, bn = 3, 40, 208, 16  # k: a 16-byte stride (TMA), not whole 128-byte boxes
    codes = torch.randint(0, 0x40, (e, n, k), dtype=torch.uint8)  # small e4m3 values: exact fp32 sums
    w = codes.view(torch.float8_e4m3fn)
    ids = torch.tensor([2, 0, 1, 2], dtype=torch.int32)
    want = w.float()[ids.long()].sum(-1)  # [TOP_K, n]
    for tiled_w in (False, True):
        out = torch.zeros(TOP_K, n)
        stream_calls(tiled(w, bn) if tiled_w else w, n, k, [ids], bn, 1, 2, tiled_w, out)[0]()
        err = float((out - want).abs().max())
        print(f"smoke stream{'-tiled' if tiled_w else ''}: max abs err {err:.3g}")
        assert err <= 1e-3 * float(want.abs().max()), "stream kernel sums differ"
    # gate_up's K loop, with and without the kernel's preamble: the 1x128-scaled product of the routed experts
    from kernels.fp8_quant import quantize_act_1x128
    e, n, k = 8, 2 * cfg_bn(), 256
    w1 = torch.randint(0, 0x40, (e, n, k), dtype=torch.uint8).view(torch.float8_e4m3fn)
    s1 = torch.rand(e, n // BK, k // BK) + 0.5
    experts = ExpertWeights(w1, s1, torch.zeros(e, n), w1[:, :k], s1[:, :k // BK], None, 0, e, 1.702, 7.0)
    x = torch.randn(1, k)
    ids = torch.tensor([5, 1, 6, 2], dtype=torch.int32)
    lg = torch.full((1, e), -5.0)
    lg[0, ids.long()] = torch.tensor([4.0, 3.0, 2.0, 1.0])  # slot j routes to ids[j]
    xq, xs = quantize_act_1x128(x)
    xf = (xq.float().view(1, k // BK, BK) * xs.view(1, -1, 1)).view(1, k)
    wf = w1.float() * s1.repeat_interleave(BK, 1).repeat_interleave(BK, 2)
    want = torch.stack([wf[i] @ xf[0] for i in ids.long()])  # [TOP_K, n]
    for preamble in (0, 1, 2):
        got = torch.zeros(TOP_K, n)
        loop_calls(experts, x, [lg], [ids], 1, 2, preamble, got)[0]()
        err = float((got - want).norm() / want.norm())
        print(f"smoke loop{PREAMBLES[preamble]}: rel err {err:.2e}")
        assert err < 1e-5, "the K loop's product differs"
    print("done")


def main() -> None:
    if SMOKE:
        return smoke()
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    ceil = measure_ceilings()
    copy = ceil["copy_TBps"] * 1e3  # GB/s
    gen = torch.Generator(device=dev).manual_seed(0)
    # Random e4m3 codes (no NaN: 0x7f / 0xff excluded) with unit scales: speed only.
    w1 = torch.randint(0, 0x7E, (E, 2 * I, H), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    w2 = torch.randint(0, 0x7E, (E, H, I), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    s1 = torch.full((E, 2 * I // BK, -(-H // BK)), 1e-3, device=dev)
    s2 = torch.full((E, -(-H // BK), -(-I // BK)), 1e-3, device=dev)
    b1 = torch.zeros(E, 2 * I, dtype=torch.bfloat16, device=dev)
    b2 = torch.zeros(E, H, dtype=torch.bfloat16, device=dev)
    experts = ExpertWeights(w1, s1, b1, w2, s2, b2, 0, E, 1.702, 7.0)
    perm = torch.randperm(E, device=dev, generator=gen)
    id_sets = [perm[i * TOP_K:(i + 1) * TOP_K].to(torch.int32).contiguous() for i in range(E // TOP_K)]
    logit_sets = []
    for ids in id_sets:
        lg = torch.full((1, E), -10.0, device=dev)
        lg[0, ids.long()] = 10.0 + torch.arange(TOP_K, device=dev, dtype=torch.float32)
        logit_sets.append(lg.to(torch.bfloat16))
    x = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
    moe = SmallBatchMoE()
    cfg = moe.config_for(TOP_K)
    sems = moe._counters.get(4096, dev)
    rows = []

    def row(what: str, part: str, nbytes: int, ms: float, note: str = "") -> None:
        gbs = nbytes / ms / 1e6
        rows.append({"what": what, "part": part, "us": ms * 1e3, "GBps": gbs, "frac_copy": gbs / copy, "note": note})
        print(f"probe {part:8s} {what:34s} {ms * 1e3:7.2f} us  {gbs:6.0f} GB/s  {gbs / copy:.2f} of copy  {note}",
              flush=True)

    gate_bytes = TOP_K * w1[0].numel()
    down_bytes = TOP_K * w2[0].numel()
    row("kernel (gate_up launch)", "gate_up", gate_bytes,
        bench([lambda lg=lg: moe.gate_up(x, lg, TOP_K, experts, cfg, sems) for lg in logit_sets]),
        f"split {cfg.split_k1}, {cfg.num_stages} stages")
    gs = [moe.gate_up(x, lg, TOP_K, experts, cfg, sems) for lg in logit_sets]
    row("kernel (down launch)", "down", down_bytes,
        bench([lambda g=g: moe.down(g, torch.bfloat16, TOP_K, experts, cfg, sems) for g in gs]),
        f"split {cfg.split_k2}")
    row("kernel (both launches)", "layer", gate_bytes + down_bytes,
        bench([lambda lg=lg: moe(x, lg, TOP_K, experts) for lg in logit_sets]))
    # Other tiles for the same kernels: split 1 drops gate_up's split-K fix-up (the stream at split 1 read as fast),
    # 4 stages read faster as a bare stream (one CTA per SM then: 96 KB more shared memory each)
    for s1, s2, st in ((1, 4, 3), (1, 4, 4), (2, 4, 4), (2, 2, 3), (2, 8, 3), (1, 8, 4)):
        alt = dataclasses.replace(cfg, split_k1=s1, split_k2=s2, num_stages=st)
        other = SmallBatchMoE(alt)
        try:
            row(f"kernel (both) split {s1}/{s2} stages {st}", "layer", gate_bytes + down_bytes,
                bench([lambda lg=lg: other(x, lg, TOP_K, experts) for lg in logit_sets]))
        except Exception as err:  # noqa: BLE001 - e.g. shared memory: report, go on
            print(f"probe layer split {s1}/{s2} stages {st}: {type(err).__name__}: {str(err)[:100]}", flush=True)
    # gate_up decomposed: the K loop alone (scales, x tile), then with the kernel's preamble (routing, x quantised)
    for split in (2,):
        for stages in (3, 4):
            for preamble in (0, 1, 2):
                row(f"loop{PREAMBLES[preamble]} split {split} stages {stages}", "gate_up", gate_bytes,
                    bench(loop_calls(experts, x, logit_sets, id_sets, split, stages, preamble)))
    w1t, w2t = tiled(w1, cfg.block_n1), tiled(w2, cfg.block_n2)
    # the bare streams at the kernel's splits (b1-probes-1 swept splits 1-8 and stages 3-4: within ~1 us)
    for part, w, wt, bn, nbytes, split in (("gate_up", w1, w1t, cfg.block_n1, gate_bytes, cfg.split_k1),
                                           ("down", w2, w2t, cfg.block_n2, down_bytes, cfg.split_k2)):
        n, k = w.shape[1], w.shape[2]
        for stages in (3, 4):
            row(f"stream split {split} stages {stages}", part, nbytes,
                bench(stream_calls(w, n, k, id_sets, bn, split, stages, False)))
        row(f"stream-tiled split {split} stages 3", part, nbytes,
            bench(stream_calls(wt, n, k, id_sets, bn, split, 3, True)))
    with open(os.path.join(out_dir, "moe_small_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "ceilings": ceil, "rows": rows}, f, indent=1)
    print("done")


if __name__ == "__main__":
    main()
