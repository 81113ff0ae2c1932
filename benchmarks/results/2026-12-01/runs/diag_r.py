"""GPU run R diagnostics (one H200): (1) the 1x128 quantiser with the hardware e4m3 conversion,
bits vs the reference and GB/s per row block; (2) DeepGEMM called directly (the product's probe
swallows its errors): dense fp8_gemm_nt at the QKV / O shapes of M = 8192 and the grouped
contiguous GEMM of the 20b MoE at 8k tokens, errors printed whole, TFLOP/s when it runs."""
from __future__ import annotations

import traceback

import torch

from benchmarks.gemm import bench
from kernels import reference as ref
from kernels.fp8_quant import quantize_act_1x128

torch.manual_seed(0)
dev = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def quant() -> None:
    for m in (8192, 32768):
        x = torch.randn(m, 2880, device=dev, dtype=torch.bfloat16) * 3
        rq, rs = ref.quantize_fp8_per_token(x)
        for bm in (16, 32, 64):
            q, s = quantize_act_1x128(x, block_m=bm)
            same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
            ms = bench([lambda: quantize_act_1x128(x, block_m=bm)])
            gb = (x.numel() * 3 + s.numel() * 4) / ms / 1e6
            print(f"quant M={m} block_m={bm}: {ms * 1e3:.1f} us {gb:.0f} GB/s bit-exact={same}")


def deepgemm() -> None:
    try:
        import deep_gemm as dg
    except Exception:
        traceback.print_exc()
        return
    print("deep_gemm", getattr(dg, "__version__", "?"), "num_sms", dg.get_num_sms())
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        m = 8192
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w, ws = ref.quantize_fp8_blockwise(torch.randn(n, k, device=dev) * 0.05)
        kp = -(-k // 128) * 128
        for kpad in (kp, -(-k // 512) * 512):
            try:
                xq, xs = quantize_act_1x128(x, k_pad=kpad, m_align=4)
                wp = torch.zeros(n, kpad, dtype=w.dtype, device=dev)
                wp[:, :k] = w
                wsp = torch.ones(-(-n // 128), kpad // 128, device=dev)
                wsp[:, :ws.shape[1]] = ws
                y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                dg.fp8_gemm_nt((xq, xs), (wp, wsp), y)
                want = ref.fp8_linear(x, w, ws, None, quantize_activations=True)
                ms = bench([lambda: dg.fp8_gemm_nt((xq, xs), (wp, wsp), y)])
                print(f"dg dense {name} M={m} N={n} K={k} pad {kpad}: err {rel(y, want):.2e} "
                      f"{ms * 1e3:.1f} us {2 * m * n * k / ms / 1e9:.0f} TFLOP/s (real K)")
            except Exception:
                print(f"dg dense {name} K pad {kpad} FAILED:")
                traceback.print_exc()
    # grouped contiguous: 20b MoE at 8k tokens, top-4 over 32 experts, 1024 rows each
    try:
        align = dg.get_mk_alignment_for_contiguous_layout()
        e, rows, kpad = 32, 1024, 2944
        for nm, n in (("gate_up", 5760), ("down", 2880)):
            a = torch.randn(e * rows, 2880, device=dev, dtype=torch.bfloat16)
            aq, as_ = quantize_act_1x128(a, k_pad=kpad, m_align=4)
            b = torch.zeros(e, n, kpad, dtype=torch.float8_e4m3fn, device=dev)
            bs = torch.ones(e, -(-n // 128), kpad // 128, device=dev)
            for i in range(e):
                q, s = ref.quantize_fp8_blockwise(torch.randn(n, 2880, device=dev) * 0.05)
                b[i, :, :2880] = q
                bs[i, :, :s.shape[1]] = s
            layout = torch.arange(e, device=dev, dtype=torch.int32).repeat_interleave(rows)
            d = torch.empty(e * rows, n, device=dev, dtype=torch.bfloat16)
            dg.m_grouped_fp8_gemm_nt_contiguous((aq, as_), (b, bs), d, layout)
            want = ref.fp8_linear(a[:rows], b[0, :, :2880], bs[0, :, :23], None, quantize_activations=True)
            ms = bench([lambda: dg.m_grouped_fp8_gemm_nt_contiguous((aq, as_), (b, bs), d, layout)])
            print(f"dg grouped {nm} align {align} 32x1024 rows N={n}: err(expert 0) {rel(d[:rows], want):.2e} "
                  f"{ms * 1e3:.1f} us {2 * e * rows * n * 2880 / ms / 1e9:.0f} TFLOP/s (real K)")
    except Exception:
        print("dg grouped FAILED:")
        traceback.print_exc()


if __name__ == "__main__":
    for f in (quant, deepgemm):
        try:
            f()
        except Exception:
            traceback.print_exc()
