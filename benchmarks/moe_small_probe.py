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

and each row's GB/s against the copy bandwidth measured in the same run. stream ~ kernel points at (b), stream ~
copy and kernel slower at (a); stream-tiled says what a tiled layout would buy. Writes $OUT/moe_small_probe.json.

    python -m benchmarks.moe_small_probe
    python -m benchmarks.moe_small_probe --smoke   # the stream kernels' sums on tiny shapes (CPU interpreter)
"""

from __future__ import annotations

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
from kernels.moe_small import SmallBatchMoE  # noqa: E402

E, H, I, TOP_K = 32, 2880, 2880, 4  # gpt-oss-20b's experts
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
    w1t, w2t = tiled(w1, cfg.block_n1), tiled(w2, cfg.block_n2)
    for part, w, wt, bn, nbytes, splits in (("gate_up", w1, w1t, cfg.block_n1, gate_bytes, (1, 2, 4)),
                                            ("down", w2, w2t, cfg.block_n2, down_bytes, (2, 4, 8))):
        n, k = w.shape[1], w.shape[2]
        for split in splits:
            for stages in (3, 4):
                row(f"stream split {split} stages {stages}", part, nbytes,
                    bench(stream_calls(w, n, k, id_sets, bn, split, stages, False)))
                row(f"stream-tiled split {split} stages {stages}", part, nbytes,
                    bench(stream_calls(wt, n, k, id_sets, bn, split, stages, True)))
    with open(os.path.join(out_dir, "moe_small_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "ceilings": ceil, "rows": rows}, f, indent=1)
    print("done")


if __name__ == "__main__":
    main()
