"""GPU run DG2 (one H200): the DeepGEMM-backed dense linear (bias in an extra K block) and prefill
MoE (kernels/moe_dg.py) at gpt-oss dims, next to cuBLASLt and the Triton MoE; grouped down tiles.
One line per measurement. `--build-only` compiles every launcher it needs (CPU machine)."""
from __future__ import annotations

import argparse
import traceback

import torch

from kernels import deepgemm_sm90 as dg
from kernels import deepgemm_linear as dl
from kernels import moe_dg

DOWN = [dg.DgConfig(128, n, mcast=2, mcast_on_a=a, gemm_type=dg.GROUPED)
        for n, a in ((128, False), (160, False), (192, False), (160, True), (192, True))]
CONFIGS = [dl.SMALL, dl.LARGE_DEFAULT, *dl.TILES.values(), moe_dg.GATE_UP, moe_dg.DOWN, *DOWN]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def grouped_down(bench) -> None:
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    e, t, hidden = 32, 8192, 2880
    ids = torch.rand(t, e, device="cuda").topk(4, dim=1).indices.flatten()
    counts = torch.bincount(ids, minlength=e)
    padded = (counts + 127) // 128 * 128
    rows = int(padded.sum())
    layout = torch.repeat_interleave(torch.arange(e, device="cuda", dtype=torch.int32), padded)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w, ws = ref.quantize_fp8_blockwise(torch.randn(e, hidden, hidden, device="cuda") * 0.05)  # [E,N,K]
    xq, xs = quantize_act_1x128(x, m_align=4)
    flops = 2 * rows * hidden * hidden
    for cfg in DOWN:
        tag = f"down grouped dg 128x{cfg.block_n} mc{cfg.mcast}{'A' if cfg.mcast_on_a else 'B'}"
        try:
            out = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
            call = lambda cfg=cfg, out=out: dg.gemm(cfg, xq, xs, w.view(-1, hidden), ws, out, layout)  # noqa: E731
            call()
            g0 = int(counts[0])
            want = ref.dequantize_fp8_per_token(xq[:g0], xs[:g0]) @ ref.dequantize_fp8_blockwise(w[0], ws[0]).t()
            ms = bench([call])
            print(f"{tag}: err(e0) {rel(out[:g0], want):.2e} {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s "
                  f"(padded rows)", flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"{tag}: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}", flush=True)


def linear(bench) -> None:
    from kernels import reference as ref
    from kernels.fp8_gemm import ScaledMMLinear
    m = 8192
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device="cuda") * 0.05)
        b = torch.randn(n, device="cuda").to(torch.bfloat16)
        want = ref.fp8_linear(x.float(), w, ws, b, quantize_activations=True)
        for impl in (ScaledMMLinear(), dl.DeepGemmLinear()):
            for bias in (b, None):
                call = lambda impl=impl, bias=bias: impl(x, w, ws, bias)  # noqa: E731
                err = rel(call(), want if bias is not None else want - b.float())
                ms = bench([call])
                print(f"linear {name} {impl.name} bias={bias is not None}: err {err:.2e} {ms * 1e3:.1f} us "
                      f"{2 * m * n * k / ms / 1e9:.0f} TFLOP/s (incl. activation quantisation)", flush=True)


def moe(bench) -> None:
    from kernels.moe import TritonMoE
    from tests.kernels.test_gemm_moe_gpu import _experts
    for e, tokens in ((32, (512, 1024, 2048, 4096, 8192, 16384)), (128, (2048, 8192))):
        w = _experts(e, 2880, 2880, fp8=True)
        for t in tokens:
            x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, e, device="cuda").to(torch.bfloat16)
            flops = 2 * t * 4 * 2880 * (5760 + 2880)
            outs = {}
            for impl in (TritonMoE(), moe_dg.DeepGemmMoE(min_rows_per_expert=0)):
                call = lambda impl=impl: impl(x, logits, 4, w)  # noqa: E731
                outs[impl.name] = call()
                ms = bench([call])
                print(f"moe E={e} T={t} {impl.name}: {ms * 1e3:.1f} us {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            print(f"moe E={e} T={t} deepgemm vs triton: rel {rel(outs['deepgemm'], outs['triton']):.2e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args()
    if args.build_only:
        for cfg in dict.fromkeys(CONFIGS):
            print(cfg, dg.library_path(cfg, 132), flush=True)
        return
    from benchmarks.gemm import bench
    torch.manual_seed(0)
    for part in (grouped_down, linear, moe):
        try:
            part(bench)
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    main()
