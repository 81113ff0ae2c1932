"""The one-token MXFP4 MoE (kernels/moe_mxfp4.py) on the GPU at gpt-oss-20b widths (32 experts, top 4, H = I = 2880),
bf16 activations: the first step of suite `mxfp4-b1`, so a wrong kernel fails before it is timed.

  * parity with the fp32 reference on the dequantised weights (the kernel rounds as the bf16 model does: the
    linears' outputs, act, the weighted slots), every swept config;
  * the same bits on every call and under CUDA-graph capture and replay, with the logits changing between replays;
  * the model: a 2-layer random 20b with Fusion.MXFP4_MOE close to the defaults' FP8 MoE, and its CUDA-graph decode.

    python -m pytest -q -m gpu tests/kernels/test_moe_mxfp4_gpu.py
"""

from __future__ import annotations

import torch

from tests.kernels.gpu_alone import GPU_ALONE
from tests.support.cuda_graph import assert_replays_track_inputs

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
    # new logits route to other experts: the counters were left zero by the replays before
    assert_replays_track_inputs(lambda: moe(x, logits, TOP_K, parts), lambda: logits.copy_(torch.randn_like(logits)))

def _config(fusions: str):
    from engine.build import EngineConfig
    from engine.scheduler import SchedulerConfig
    return EngineConfig(random_preset="gpt-oss-20b", random_layers=2, device=DEV, dtype="bfloat16", fp8=True,
                        attention_backend="flashinfer", linear_backend="scaled_mm", moe_backend="triton",
                        fusions=fusions, kv_cache_bytes=2 << 30, mxfp4_experts=True,
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=4096))


def test_model_and_graph_decode_with_mxfp4_moe():
    """Decode steps of a 2-layer random 20b that kept its MXFP4 experts: with Fusion.MXFP4_MOE the hidden states sit
    close to the defaults' FP8 MoE (W4A16 against W8A8: x and act not quantised), a prefill chunk's bits do not move;
    the engine's CUDA-graph decode with it decodes every token."""
    import pytest

    pytest.importorskip("flashinfer")
    from engine.build import load_model
    from kernels.registry import DEFAULT_FUSIONS
    from tests.support.model_steps import graph_decode_decodes_every_token, steps_by_setting

    base, mx = DEFAULT_FUSIONS, DEFAULT_FUSIONS + "+mxfp4_moe"
    model = load_model(_config(base))
    assert all(layer.mlp.mx is not None for layer in model.layers)
    lens = (300, 1, 1, 1, 1)
    outs = steps_by_setting(model, [base, mx], lens, DEV)
    assert torch.equal(outs[0][mx], outs[0][base])  # a prefill chunk: one-token steps only
    errs = [_rel(o[mx], o[base]) for o in outs[1:]]
    # judged by the bulk of the steps, as the rows kernels' W8A16 test: a token near a routing tie may swap an expert
    assert 0 < sorted(errs)[len(errs) // 2] < 5e-2, errs
    del model, outs
    torch.cuda.empty_cache()
    graph_decode_decodes_every_token(_config(mx))
