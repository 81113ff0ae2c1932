"""The launch-saving fusions (kernels.registry.Fusion) against the unfused kernels and the torch
reference, in the Triton CPU interpreter (fp32 and fp16: the interpreter's bf16 arithmetic is not
exact). GPU twins in tests/kernels/test_fusion_gpu.py.

  * rope_store: q/k RoPE + the K/V store in one launch == apply_rope, apply_rope, store_kv (bits),
    bf16-like and e4m3 pages; through both attention backends (FlashInfer's planning on its torch
    stand-in) == the same backend fed pre-rotated q/k, cache bits included;
  * norm_router / norm_quant: fused_norm's y has the bits of the plain add + norm, its e4m3 copy the
    bits of quantize_act_1x128(y), its logits F.linear(y)'s up to summation order;
  * the model with each fusion on == off: bit-identical except the router (logits' last bit).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.selftest import SelfTestShape, self_test_attention  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.fp8_quant import quantize_act_1x128  # noqa: E402
from kernels.norm import add_rms_norm, fused_norm, rms_norm  # noqa: E402
from kernels.registry import Fusion, fusions_name, parse_fusions  # noqa: E402
from kernels.triton_attention_backend import TritonAttention  # noqa: E402
from kernels.triton_store_kv import apply_rope, rope_qk, rope_qk_store_kv, store_kv  # noqa: E402

FP8 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == FP8 else x


def _qkv_case(t, hq, hkv, d, dtype, seed, scale=1.0):
    """q/k/v as strided views of one fused QKV row (what the model passes), cos/sin, slots with a skip."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * scale).to(dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.randint(0, 5000, (t,), generator=g).float()
    inv = 1.0 / (150000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = (pos[:, None] * inv).cos() * 1.35, (pos[:, None] * inv).sin() * 1.35
    slots = torch.randperm(10 * 4, generator=g)[:t]
    if t > 2:
        slots[1] = -1
    return q, k, v, cos, sin, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 64, 8, 64), (7, 8, 2, 16), (37, 4, 4, 32)])
@pytest.mark.parametrize("write_k", [False, True])
def test_rope_qk_store_kv_equals_three_launches(dtype, t, hq, hkv, d, write_k):
    q, k, v, cos, sin, slots = _qkv_case(t, hq, hkv, d, dtype, seed=t)
    kc = torch.randn(10, hkv, 4, d).to(dtype)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    q_rot, k_rot = rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, write_k=write_k)
    q_ref, k_ref = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    assert torch.equal(q_rot, apply_rope(q, cos, sin)) and torch.equal(q_rot, q_ref) and q_rot.is_contiguous()
    assert (k_rot is None) != write_k and (k_rot is None or torch.equal(k_rot, k_ref))
    store_kv(k_ref, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_qk_store_kv_fp8_pages(dtype):
    q, k, v, cos, sin, slots = _qkv_case(9, 8, 2, 16, dtype, seed=3, scale=40.0)  # some saturate at 448 * scale
    scales = (torch.tensor([0.07, 0.5]), torch.tensor([0.02, 0.3]))
    kc = torch.zeros(10, 2, 4, 16, dtype=FP8)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    q_rot, _ = rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, scales)
    ref.store_kv(ref.apply_rope(k, cos, sin), v, kc2, vc2, slots, scales)
    assert torch.equal(q_rot, ref.apply_rope(q, cos, sin))
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))
    rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin)  # no scales = 1.0
    ref.store_kv(ref.apply_rope(k, cos, sin), v, kc2, vc2, slots)
    assert torch.equal(_bits(kc), _bits(kc2)) and torch.equal(_bits(vc), _bits(vc2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hq,hkv,d", [(0, 4, 2, 16), (1, 64, 8, 64), (7, 8, 2, 16), (37, 4, 4, 32)])
def test_rope_qk_one_launch_equals_two_apply_rope(dtype, t, hq, hkv, d):
    """rope_qk: the fused kernel with nothing stored, the bits of two apply_rope launches, on strided views."""
    q, k, _, cos, sin, _ = _qkv_case(t, hq, hkv, d, dtype, seed=t + 1)
    q_rot, k_rot = rope_qk(q, k, cos, sin)
    assert torch.equal(q_rot, apply_rope(q, cos, sin)) and torch.equal(k_rot, apply_rope(k, cos, sin))
    assert torch.equal(q_rot, ref.apply_rope(q, cos, sin)) and torch.equal(k_rot, ref.apply_rope(k, cos, sin))
    assert q_rot.is_contiguous() and k_rot.is_contiguous()


def test_rope_qk_store_kv_no_tokens():
    q, k, v, cos, sin, slots = _qkv_case(0, 4, 2, 16, torch.float32, seed=0)
    q_rot, k_rot = rope_qk_store_kv(q, k, v, torch.zeros(2, 2, 4, 16), torch.zeros(2, 2, 4, 16), slots, cos, sin,
                                    write_k=True)
    assert q_rot.shape == (0, 4, 16) and k_rot.shape == (0, 2, 16)


SMALL = SelfTestShape(num_q_heads=8, num_kv_heads=2, head_dim=16, window=8, page_size=4)


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_triton_backend_self_test_with_rope(kv_dtype):
    """The start-up self-test with q/k unrotated (rope=): decode, prefill longer than the ring, a
    chunk on a cached prefix; the cache bytes equal the reference's."""
    self_test_attention(TritonAttention(), "cpu", torch.float32, shape=SMALL, kv_dtype=kv_dtype, rope=True)


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_flashinfer_backend_self_test_with_rope(fake_flashinfer, kv_dtype):
    self_test_attention(fake_flashinfer.FlashInferAttention(), "cpu", torch.float32, shape=SMALL, kv_dtype=kv_dtype,
                        rope=True)


# ---- norms ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
# E % 4 != 0 too; 65 tokens: one program quantises each row (fewer: the row's groups spread over its programs)
@pytest.mark.parametrize("t,h,e", [(1, 2880, 32), (3, 2880, 128), (5, 96, 5), (2, 300, 2), (65, 300, 3)])
@pytest.mark.parametrize("delta", [True, False])
def test_fused_norm_variants(dtype, t, h, e, delta):
    g = torch.Generator().manual_seed(t * 100 + h + e)
    x = (torch.randn(t, h, generator=g) * 3).to(dtype)
    d = torch.randn(t, h, generator=g).to(dtype) if delta else None
    w = 1 + 0.1 * torch.randn(h, generator=g)
    rw = (torch.randn(e, h, generator=g) * 0.05).to(dtype)
    rb = torch.randn(e, generator=g).to(dtype)
    plain = fused_norm(x, d, w, 1e-5)
    full = fused_norm(x, d, w, 1e-5, quant=True, router=(rw, rb))
    xs = x + d if delta else x
    assert torch.equal(full.x, xs) and torch.equal(plain.x, xs)
    assert torch.equal(full.y, plain.y)  # same bits in the interpreter (on a GPU: up to the last bit)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(full.y, ref.rms_norm(xs, w, 1e-5), rtol=tol, atol=tol)
    yq, ys = quantize_act_1x128(full.y)
    assert torch.equal(_bits(full.yq), _bits(yq)) and torch.equal(full.ys, ys) and full.ys.stride() == ys.stride()
    alone = fused_norm(x, d, w, 1e-5, quant=True)  # without the router: its own program count
    assert torch.equal(alone.y, plain.y) and torch.equal(_bits(alone.yq), _bits(yq)) and torch.equal(alone.ys, ys)
    # logits: a sum over H in another order than F.linear's, rounded once to the logits dtype
    ltol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-3, atol=1e-2)
    want = torch.nn.functional.linear(full.y.float(), rw.float(), rb.float()).to(dtype)
    torch.testing.assert_close(full.logits, want, **ltol)
    assert torch.equal(full.logits.topk(min(e, 4)).indices, want.topk(min(e, 4)).indices)
    no_bias = fused_norm(x, d, w, 1e-5, router=(rw, None))
    torch.testing.assert_close(no_bias.logits, torch.nn.functional.linear(full.y.float(), rw.float()).to(dtype), **ltol)


def test_fused_norm_no_tokens_and_wrappers():
    x = torch.zeros(0, 64)
    out = fused_norm(x, x, torch.ones(64), 1e-5, quant=True, router=(torch.ones(4, 64), None))
    assert out.y.shape == (0, 64) and out.yq.shape == (0, 64) and out.logits.shape == (0, 4)
    g = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(3, 200, generator=g), torch.randn(3, 200, generator=g), torch.rand(200, generator=g)
    assert torch.equal(rms_norm(x, w, 1e-5), fused_norm(x, None, w, 1e-5).y)
    xo, y = add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(xo, x + d) and torch.equal(y, fused_norm(x, d, w, 1e-5).y)


def test_parse_fusions():
    assert parse_fusions("off") == frozenset() and parse_fusions("on") == frozenset(Fusion)
    assert parse_fusions("rope_store+norm_quant") == {Fusion.ROPE_STORE, Fusion.NORM_QUANT}
    assert fusions_name(parse_fusions("norm_router+rope_store")) == "norm_router+rope_store"
    assert fusions_name(frozenset(Fusion)) == "on" and fusions_name(frozenset()) == "off"
    from common.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown fusion"):
        parse_fusions("rope")


# ---- the model: each fusion on against all off ------------------------------------------------------
def test_model_with_fusions_matches_without(ckpt_factory, one_torch_thread):
    """tiny-a with FP8 experts on the Triton MoE, FP8 QKV/O on the Triton linear (activations quantised
    1x128, as fp8_gemv's kernel does) and Triton attention: a 13-token prefill chunk (the grouped MoE, which
    takes the norm's FP8 copy), decodes (the few-token MoE) and a 6-token chunk, one KV pool per setting.
    rope_store and norm_quant give the bits of the unfused model; norm_router's logits and fp8_gemv's
    projections may differ in the last bit (another summation order); fp8_rows (one-token steps only) leaves
    the projections' x unquantised: off the W8A8 bits by the activations' quantisation error."""
    from kernels.registry import make_backends
    from model.context import SeqStep, build_step_meta
    from model.gpt_oss import GptOss
    from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache
    from model.loader import load_weights
    from model.weights import SafetensorsSource

    src = SafetensorsSource(ckpt_factory("tiny-a"))
    model = GptOss(src.config, make_backends("triton", "triton", "triton"), dtype=torch.float32, fp8=True)
    load_weights(model, src, progress=False)
    settings = ["off", "rope_store", "norm_quant", "norm_router", "fp8_gemv", "fp8_rows", "on"]
    # The settings whose one-token steps differ from off's (W8A16 projections) start every step from off's KV, so
    # each step is judged alone; their reference: the same weights on the torch linear (W dequantised, x
    # unquantised) and the Triton MoE, from the same KV.
    apart = ("fp8_rows", "on")
    w8a16 = GptOss(src.config, make_backends("triton", "torch", "triton"), dtype=torch.float32, fp8=True)
    load_weights(w8a16, src, progress=False)
    spec = plan_kv_cache(model.cfg, 1 << 20, page_size=4, max_num_seqs=2, dtype=torch.float32)
    mgr = KVManager(spec)
    pools = {s: KVPool(spec) for s in settings}
    pages = SeqPages()
    ids = torch.randint(0, model.cfg.vocab_size, (22,), generator=torch.Generator().manual_seed(0))
    pos = 0
    for n in (13, 1, 1, 6, 1):
        mgr.grow(pages, pos + n)
        meta = build_step_meta([SeqStep(pages, pos, n)], spec)
        out = {}
        for s in (*apart, "w8a16"):
            pools.setdefault(s, KVPool(spec))
            for a, b in zip(pools[s].pools, pools["off"].pools):
                a.copy_(b)
        want = w8a16(ids[pos:pos + n], meta, pools["w8a16"])
        for s in settings:
            model.backends.fusions = parse_fusions(s)
            out[s] = model(ids[pos:pos + n], meta, pools[s])
        for s in ("rope_store", "norm_quant"):
            assert torch.equal(out[s], out["off"]), (n, s)
            assert all(torch.equal(a, b) for a, b in zip(pools[s].pools, pools["off"].pools)), (n, s)
        for s in ("norm_router", "fp8_gemv") + (("on",) if n > 1 else ()):
            torch.testing.assert_close(out[s], out["off"], rtol=1e-4, atol=1e-4)
        if n > 1:  # the rows kernel takes one-token steps only
            assert torch.equal(out["fp8_rows"], out["off"]), n
        else:  # W8A16 at one token: x not quantised
            err = float((out["fp8_rows"] - out["off"]).norm() / out["off"].norm())
            assert 0 < err < 0.1, (n, err)  # engaged: off the W8A8 bits by the activations' quantisation
            torch.testing.assert_close(out["fp8_rows"], want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(out["on"], want, rtol=1e-4, atol=1e-4)
        pos += n


# ---- the DeepGEMM MoE's SwiGLU pass: one expert and b1 row per program ------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("t,e,el,start", [(9, 8, 8, 0), (12, 8, 4, 4)])
def test_swiglu_tile_expert_same_bits(monkeypatch, t, e, el, start):
    """SWIGLU_TILE_EXPERT (b1 per program, unused tiles skipped) == per-row loads, whole MoE, bit for bit."""
    from kernels import moe_dg
    from tests.kernels.test_moe import _experts, _logits

    torch.manual_seed(t)
    x = torch.randn(t, 200)
    logits = _logits(t, e, torch.float32)
    w = _experts(e, el, 200, 72, torch.float32, fp8=True, start=start, b2=True)
    out = {}
    for tile in (False, True):
        monkeypatch.setattr(moe_dg, "SWIGLU_TILE_EXPERT", tile)
        out[tile] = moe_dg.DeepGemmMoE(min_rows_per_expert=0)(x, logits, 4, w)
    assert torch.equal(out[True], out[False])


def test_norm_router_takes_steps_by_tokens_times_experts():
    """Fusion.NORM_ROUTER runs while T x E <= ROUTER_FUSION_MAX_WORK: 20b (E 32) up to 64 tokens, 120b (E 128) up to
    16 (fusion-ab-1: at 64 tokens the fused launch took 15.6 us for 120b against cuBLAS's 8.4)."""
    from kernels.registry import Backends, Fusion

    be = Backends(None, None, None, fused_norm=True, fusions=frozenset({Fusion.NORM_ROUTER}))
    assert be.norm_router(1, 32) and be.norm_router(64, 32) and be.norm_router(1, 128) and be.norm_router(16, 128)
    assert not be.norm_router(65, 32) and not be.norm_router(17, 128) and not be.norm_router(64, 128)
    assert not Backends(None, None, None, fused_norm=False, fusions=frozenset({Fusion.NORM_ROUTER})).norm_router(1, 32)
    assert not Backends(None, None, None, fused_norm=True).norm_router(1, 32)


def test_fusion_benchmark_norm_rows_smoke(monkeypatch):
    """benchmarks.fusion's norm rows run on CPU (interpreter, no timing): one token times the spread quantisation
    against one program per row, and the knob it turns for that is restored."""
    from benchmarks import fusion
    from kernels import norm

    monkeypatch.setattr(fusion, "DEV", "cpu")
    monkeypatch.setattr(fusion, "graph_us", lambda fn, reps: (fn(), 1.0)[1])
    rows = fusion.norm_rows(1, 1, 1.0)
    names = {(r["what"], r["variant"]) for r in rows}
    assert {("norm+quant", "fused spread"), ("norm+quant", "fused one program"),
            ("norm+router+quant E32", "fused spread"), ("norm+router+quant E32", "fused one program")} <= names
    assert norm.QUANT_SPREAD_MAX_TOKENS == 64
