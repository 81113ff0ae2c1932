"""The one-token MXFP4 MoE (kernels/moe_mxfp4.py) on the GPU at gpt-oss-20b widths (32 experts, top 4, H = I = 2880),
bf16 activations: the first step of suite `mxfp4-b1`, so a wrong kernel fails before it is timed.

  * parity with the fp32 reference on the dequantised weights (the kernel rounds as the bf16 model does: the
    linears' outputs, act, the weighted slots), every swept config;
  * the same bits on every call and under CUDA-graph capture and replay, with the logits changing between replays.

    python -m pytest -q -m gpu tests/kernels/test_moe_mxfp4_gpu.py
"""

from __future__ import annotations

import torch

from tests.kernels.gpu_alone import GPU_ALONE
from tests.support.cuda_graph import capture

pytestmark = GPU_ALONE

DEV = "cuda"
E, TOP_K, H, I = 32, 4, 2880, 2880


def _case(seed: int):
    from benchmarks.moe_mxfp4_b1 import random_mxfp4_experts

    g = torch.Generator(device=DEV).manual_seed(seed)
    parts = random_mxfp4_experts(E, H, I, DEV, g)
    x = torch.randn(1, H, device=DEV, generator=g).to(torch.bfloat16)
    logits = torch.randn(1, E, device=DEV, generator=g).to(torch.bfloat16)
    return parts, x, logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_parity_every_config_and_bits():
    from benchmarks.moe_mxfp4_b1 import mxfp4_configs, reference_out
    from kernels.moe_mxfp4 import SmallBatchMxfp4MoE

    parts, x, logits = _case(0)
    want = reference_out(x, logits, TOP_K, parts)  # fp32 on the dequantised weights, routing in bf16
    for cfg in mxfp4_configs(sweep=True):
        moe = SmallBatchMxfp4MoE(cfg)
        y = moe(x, logits, TOP_K, parts)
        assert y.dtype == torch.bfloat16 and y.shape == (1, H)
        assert _rel(y, want) < 1e-2, (cfg, _rel(y, want))  # a few bf16 roundings of fp32 sums
        for _ in range(3):
            assert torch.equal(moe(x, logits, TOP_K, parts), y), cfg


def test_cuda_graph_replay_same_bits():
    from kernels.moe_mxfp4 import SmallBatchMxfp4MoE

    parts, x, logits = _case(1)
    moe = SmallBatchMxfp4MoE()
    fn = lambda: moe(x, logits, TOP_K, parts)  # noqa: E731
    eager = fn()
    g, out = capture(fn)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    logits.copy_(torch.randn_like(logits))  # other experts: the counters were left zero by the replays before
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())
