"""The fusions (kernels.registry.Fusion) on the GPU at gpt-oss dims, bf16, hardware e4m3 conversions:
the first step of suite `fusion-ab`, so a wrong kernel fails before anything is timed.

  * rope_store: q/k RoPE + K/V store in one launch == the three launches, bit for bit (bf16 and e4m3
    pages, 1 .. 8192 tokens), and rope_qk (the same kernel storing nothing) == two apply_rope launches; both
    attention backends' start-up self-test with rope=;
  * norm_router / norm_quant: y bits equal across variants, the e4m3 copy == quantize_act_1x128(y),
    logits == F.linear's up to the last bf16 bit; the MoE backends with x_fp8 == without;
  * the model: 2 full-width 20b layers, FlashInfer: rope_store + norm_quant give the unfused bits,
    all fusions stay within bf16 noise; the engine's CUDA-graph decode with the exact fusions gives
    the tokens of the unfused engine.

Run alone (CPU kernel tests set TRITON_INTERPRET=1 at import):
    python -m pytest -q -m gpu tests/kernels/test_fusion_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_alone import GPU_ALONE

pytestmark = GPU_ALONE

DEV = "cuda"
HQ, HKV, D, P, H = 64, 8, 64, 16, 2880
FP8 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


@pytest.mark.parametrize("t", [1, 64, 8192])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_rope_qk_store_kv_exact(t, kv):
    from kernels import reference as ref
    from kernels.triton_store_kv import apply_rope, rope_qk, rope_qk_store_kv, store_kv

    g = torch.Generator(device=DEV).manual_seed(t)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, generator=g).to(torch.bfloat16) * 4
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    pos = torch.randint(0, 100_000, (t,), device=DEV, generator=g).float()
    inv = 1.0 / (150000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    cos, sin = (pos[:, None] * inv).cos() * 1.3466, (pos[:, None] * inv).sin() * 1.3466
    pages = -(-t // P) + 3
    slots = torch.randperm(pages * P, device=DEV, generator=g)[:t]
    slots[0] = -1  # a skipped token (a sliding layer's chunk head)
    dtype = FP8 if kv == "fp8" else torch.bfloat16
    kc = torch.zeros(pages, HKV, P, D, device=DEV, dtype=dtype)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    scales = (torch.rand(HKV, device=DEV) * 0.2 + 0.01, torch.rand(HKV, device=DEV) * 0.05 + 0.01) if kv == "fp8" else None
    q_rot, k_rot = rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, scales, write_k=True)
    q_ref, k_ref = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q_one, k_one = rope_qk(q, k, cos, sin)  # the one-launch rotation (nothing stored)
    assert torch.equal(q_one, q_ref) and torch.equal(k_one, k_ref)
    store_kv(k_ref, v, kc2, vc2, slots, scales)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    assert torch.equal(q_rot, ref.apply_rope(q, cos, sin))
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))


# FlashInfer over e4m3 pages needs two more JIT builds (~13 s each): its fused store is Triton's, covered above
@pytest.mark.parametrize("backend,kv", [("triton", "bf16"), ("triton", "fp8"), ("flashinfer", "bf16")])
def test_attention_self_test_with_rope(backend, kv):
    from engine.selftest import SelfTestShape, self_test_attention
    from kernels.registry import make_attention

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    shape = SelfTestShape(HQ, HKV, D, 128, P)
    self_test_attention(make_attention(backend), DEV, torch.bfloat16, shape=shape,
                        kv_dtype=FP8 if kv == "fp8" else None, rope=True)


@pytest.mark.parametrize("t", [1, 7, 64, 8192])
@pytest.mark.parametrize("e", [32, 128])
def test_fused_norm_real_dims(t, e):
    from kernels import reference as ref
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.norm import add_rms_norm, fused_norm

    g = torch.Generator(device=DEV).manual_seed(t + e)
    x = (torch.randn(t, H, device=DEV, generator=g) * 4).to(torch.bfloat16)
    d = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(H, device=DEV, generator=g)
    rw = (torch.randn(e, H, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    rb = (torch.randn(e, device=DEV, generator=g) * 0.1).to(torch.bfloat16)
    xo, y = add_rms_norm(x, d, w, 1e-5)
    full = fused_norm(x, d, w, 1e-5, quant=True, router=(rw, rb))
    assert torch.equal(xo, x + d) and torch.equal(full.x, xo)
    # With the router's loads in the launch, Triton may lay the row out otherwise and sum x^2 in
    # another order: y can differ in the last bit (fusion-ab run 1: 3 of 8 shapes), no more.
    ulps = ((full.y.view(torch.int16).int() - y.view(torch.int16).int()).abs())
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.02
    torch.testing.assert_close(y.float(), ref.rms_norm(x + d, w, 1e-5).float(), rtol=8e-3, atol=1e-2)
    y = full.y  # the MoE's FP8 copy is of the y the fused launch wrote
    yq, ys = quantize_act_1x128(y)
    assert torch.equal(_bits(full.yq), _bits(yq)) and torch.equal(full.ys, ys)
    alone = fused_norm(x, d, w, 1e-5, quant=True)  # no router: up to 64 tokens its own spread of the groups
    yq, ys = quantize_act_1x128(alone.y)
    assert torch.equal(_bits(alone.yq), _bits(yq)) and torch.equal(alone.ys, ys)
    want = torch.nn.functional.linear(y, rw, rb)
    torch.testing.assert_close(full.logits.float(), want.float(), rtol=8e-3, atol=8e-3)
    # mostly the same bits: the sum order differs (and where cuBLAS adds the bias, one more rounding)
    assert (full.logits != want).float().mean() < 0.25


@pytest.mark.parametrize("backend,t", [("triton", 64), ("triton", 2048), ("deepgemm", 8192), ("deepgemm", 64)])
def test_moe_takes_the_norms_fp8_copy(backend, t):
    """x_fp8 = quantize_act_1x128(x) handed in == the MoE quantising x itself, bit for bit."""
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.registry import make_moe
    from tests.kernels.test_gemm_moe_gpu import _experts

    moe = make_moe(backend)
    if backend == "deepgemm":
        from kernels import deepgemm_sm90 as dg
        from kernels.moe_dg import DOWN, GATE_UP
        why = dg.unavailable_reason([GATE_UP, DOWN], torch.device(DEV))
        if why:
            pytest.skip(f"DeepGEMM unavailable: {why}")
    w = _experts(32, H, H, fp8=True)
    x = torch.randn(t, H, device=DEV).to(torch.bfloat16)
    logits = torch.randn(t, 32, device=DEV).to(torch.bfloat16)
    assert moe.takes_fp8_input(t, 4, w)
    assert torch.equal(moe(x, logits, 4, w, quantize_act_1x128(x)), moe(x, logits, 4, w))
    x1, l1 = x[:1].contiguous(), logits[:1].contiguous()  # the few-token path takes it too (b1-probes-2)
    assert moe.takes_fp8_input(1, 4, w)
    assert torch.equal(moe(x1, l1, 4, w, quantize_act_1x128(x1)), moe(x1, l1, 4, w))


@pytest.mark.parametrize("t", [8192, 1024])
def test_deepgemm_swiglu_tile_expert_same_bits(monkeypatch, t):
    """kernels.moe_dg.SWIGLU_TILE_EXPERT (one b1 row per program, unused tiles skipped): the MoE's
    output bit for bit (DeepGEMM never reads the rows it skips)."""
    from kernels import deepgemm_sm90 as dg
    from kernels import moe_dg
    from tests.kernels.test_gemm_moe_gpu import _experts

    why = dg.unavailable_reason([moe_dg.GATE_UP, moe_dg.DOWN], torch.device(DEV))
    if why:
        pytest.skip(f"DeepGEMM unavailable: {why}")
    w = _experts(32, H, H, fp8=True)
    x = torch.randn(t, H, device=DEV).to(torch.bfloat16)
    logits = torch.randn(t, 32, device=DEV).to(torch.bfloat16)
    out = {}
    for tile in (False, True):
        monkeypatch.setattr(moe_dg, "SWIGLU_TILE_EXPERT", tile)
        out[tile] = moe_dg.DeepGemmMoE(min_rows_per_expert=0)(x, logits, 4, w)
    assert torch.equal(out[True], out[False])


def _config(fusions: str, layers: int = 2):
    from engine.build import EngineConfig
    from engine.scheduler import SchedulerConfig
    return EngineConfig(random_preset="gpt-oss-20b", random_layers=layers, device=DEV, dtype="bfloat16", fp8=True,
                        fp8_attention=False, attention_backend="flashinfer", linear_backend="scaled_mm",
                        moe_backend="triton", fusions=fusions, kv_cache_bytes=2 << 30,
                        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=4096))


def test_model_fusions_real_widths():
    """One model, one KV pool per setting: a 300-token prefill (grouped MoE: the norm's FP8 copy),
    a 40-token chunk (router in the norm), decodes. rope_store + norm_quant: the unfused bits."""
    pytest.importorskip("flashinfer")
    from engine.build import load_model
    from kernels.registry import parse_fusions
    from model.context import SeqStep, build_step_meta
    from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache

    model = load_model(_config("off"))
    settings = ["off", "rope_store+norm_quant", "on"]
    spec = plan_kv_cache(model.cfg, 1 << 30, page_size=P, max_num_seqs=2, dtype=torch.bfloat16)
    mgr = KVManager(spec)
    pools = {s: KVPool(spec, DEV) for s in settings}
    pages = SeqPages()
    ids = torch.randint(0, model.cfg.vocab_size, (350,), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    pos, row_err = 0, []
    for n in (300, 40, 1, 1, 1):
        mgr.grow(pages, pos + n)
        meta = build_step_meta([SeqStep(pages, pos, n)], spec, DEV)
        out = {}
        for s in settings:
            model.backends.fusions = parse_fusions(s)
            out[s] = model(ids[pos:pos + n], meta, pools[s])
        assert torch.equal(out["rope_store+norm_quant"], out["off"]), n
        assert all(torch.equal(a, b) for a, b in zip(pools["rope_store+norm_quant"].pools, pools["off"].pools)), n
        assert torch.isfinite(out["on"]).all()
        a, b = out["on"].float(), out["off"].float()
        row_err += ((a - b).norm(dim=-1) / b.norm(dim=-1)).tolist()
        pos += n
    # all on: a router logit's last bit may swap the 4th expert of a token near a tie, so judge the rows
    # by their bulk, not the worst
    assert torch.tensor(row_err).quantile(0.9) < 3e-2, sorted(row_err)[-5:]


def test_engine_graph_decode_exact_fusions_same_tokens():
    """The engine with CUDA-graph decode (FlashInfer): the bit-exact fusions give the tokens of the
    unfused engine; all fusions on run (graph capture included) and decode every token."""
    pytest.importorskip("flashinfer")
    import dataclasses

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 100_000, (n,), generator=g).tolist() for n in (700, 33, 1)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    for fusions in ("off", "rope_store+norm_quant", "on"):
        llm = LLM(dataclasses.replace(_config(fusions), cuda_graphs=True))  # captures its decode graphs
        assert llm.engine.runner.graphs is not None
        outs[fusions] = [c.output_ids for c in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert outs["rope_store+norm_quant"] == outs["off"]
    assert all(len(o) == 12 for o in outs["on"])
