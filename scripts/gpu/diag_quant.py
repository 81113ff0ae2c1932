"""Diagnose test_quant_bit_exact_on_gpu: where the Triton 1x128 quantiser and the torch reference
disagree on the H200 (values, scales, codes)."""
import torch

from kernels import reference as ref
from kernels.fp8_quant import quantize_act_1x128

torch.manual_seed(0)
x = torch.randn(4099, 2880, device="cuda", dtype=torch.bfloat16) * 3
q, s = quantize_act_1x128(x, m_align=4)
rq, rs = ref.quantize_fp8_per_token(x)
print("scales equal:", torch.equal(s, rs), "max scale rel diff:", ((s - rs).abs() / rs).max().item())
d = (q.view(torch.uint8) != rq.view(torch.uint8))
print("code mismatches:", int(d.sum()), "of", d.numel())
idx = d.nonzero()[:8]
for r, c in idx.tolist():
    sc = rs[r, c // 128].item()
    v = x[r, c].float().item()
    print(f"row {r} col {c}: x={v!r} scale={sc!r} x/scale={v / sc!r} torch_div={(x[r, c].float() / rs[r, c // 128]).item()!r} "
          f"triton_q={q[r, c].float().item()!r} ref_q={rq[r, c].float().item()!r}")
