"""FP8 (e4m3) KV end to end on the CPU, tiny fp32 gpt-oss (real vocabulary, window 128, page 16).

  * the paged engine with FP8 pages computes exactly the model whose K/V are quantised and
    dequantised in place before an fp32 cache (fake quantisation, the same steps and batches): same
    logits to fp32 rounding, prefill and teacher-forced decode, default and calibrated scales;
  * against fp32 and bf16 KV: teacher-forced top-1 agreement and logit deltas, and free-running greedy
    agreement (printed; pytest -s shows the table); every page back after each run;
  * the Triton backend (interpreter) produces the same tokens as the torch reference with FP8 pages;
  * disaggregated serving (router + prefill + decode processes, KV over NIXL) with FP8 KV and
    start-up calibration on both roles returns the single-process FP8 engine's tokens, pages all back;
  * NIXL between processes: FP8 pages land byte-exact; a bf16 prefill and an FP8 decode refuse
    each other at the handshake, naming the dtypes, with every page freed.
"""

from __future__ import annotations

import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig
from kernels import reference as ref
from kernels.torch_backend import TorchAttention
from model.context import SeqStep, build_step_meta
from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache
from model.kv_scales import KVScales

FP8 = torch.float8_e4m3fn
VOCAB = 201088


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_model(ckpt_factory):
    from engine.build import load_model

    return load_model(EngineConfig(checkpoint=ckpt_factory("tiny")))


class _FakeQuantKV:
    """The reference attention over an fp32 cache, fed K/V quantised to e4m3 and back (per-head
    scales of the layer, taken in call order): the math FP8 pages must reproduce."""

    name = "fake-quant"

    def __init__(self, scales: KVScales) -> None:
        self.inner, self.scales, self.layer = TorchAttention(), scales, 0

    def plan(self, step) -> None:
        self.layer = 0
        self.inner.plan(step)

    def forward(self, group, q, k, v, kv, sinks, sm_scale, window, kv_scale=None, rope=None):
        ks, vs = self.scales.k[self.layer], self.scales.v[self.layer]
        self.layer += 1
        if rope is not None:  # Fusion.ROPE_STORE (the default): the cache holds rotated keys
            q, k = ref.apply_rope(q, *rope), ref.apply_rope(k, *rope)
        k = ref.dequantize_kv(ref.quantize_kv(k, ks), ks)
        v = ref.dequantize_kv(ref.quantize_kv(v, vs), vs)
        return self.inner.forward(group, q, k, v, kv, sinks, sm_scale, window)


def _teacher_forced(model, tokens, prompt_len, dtype, scales=None, attention=None):
    """Logits [len(tokens) - prompt_len + 1, V]: prefill the prompt, then decode the rest one by one
    (with `attention` in place of the model's backend if given)."""
    spec = plan_kv_cache(model.cfg, 8 << 20, page_size=16, max_num_seqs=2, dtype=dtype)
    pool, kv, pages = KVPool(spec, scales=scales), KVManager(spec), SeqPages()
    be = model.backends
    inner = be.attention
    be.attention = attention or inner
    try:
        kv.grow(pages, prompt_len)
        meta = build_step_meta([SeqStep(pages, 0, prompt_len)], spec)
        out = [model.compute_logits(model(torch.tensor(tokens[:prompt_len]), meta, pool)[meta.logits_indices])[0]]
        for pos in range(prompt_len, len(tokens)):
            kv.grow(pages, pos + 1)
            meta = build_step_meta([SeqStep(pages, pos, 1)], spec)
            out.append(model.compute_logits(model(torch.tensor(tokens[pos:pos + 1]), meta, pool))[0])
    finally:
        be.attention = inner
    kv.release(pages)
    kv.assert_all_free()
    return torch.stack(out)


@pytest.mark.parametrize("calibrated", [False, True])
def test_fp8_kv_paged_engine_equals_the_fake_quantised_model(tiny_model, calibrated):
    """Prompt within one sliding ring (every step stores, then reads its keys from the pages)."""
    cfg = tiny_model.cfg
    tokens = _prompts([120 + 24])[0]
    if calibrated:
        from engine.kv_calibration import calibration_prompts, measure_kv_amax

        scales = KVScales.from_amax(*measure_kv_amax(tiny_model, calibration_prompts(1, cfg.vocab_size)), "calibrated:1")
        assert float(scales.k.max()) < 1  # |K| < 448 / 2 * scale: scales below 1 for this model
    else:
        scales = KVScales.default(cfg.num_hidden_layers, cfg.num_key_value_heads)
    paged = _teacher_forced(tiny_model, tokens, 120, FP8, scales)
    fake = _teacher_forced(tiny_model, tokens, 120, torch.float32, attention=_FakeQuantKV(scales))
    exact = _teacher_forced(tiny_model, tokens, 120, torch.float32)
    torch.testing.assert_close(paged, fake, atol=2e-4, rtol=1e-4)
    assert (paged - exact).abs().max() > 1e-2  # the pages really were FP8


def test_fp8_kv_agreement_with_fp32_and_bf16_kv(tiny_model):
    """Teacher-forced: the same token sequence scored with each KV dtype, against fp32 KV: logit
    deltas (the median over positions of each position's rms delta, relative to the logits' spread:
    robust to the few positions where a perturbation flips an expert choice and the output jumps)
    and top-1 agreement. Thresholds leave room; the measured values are printed."""
    tokens = _prompts([200 + 40], seed=1)[0]
    want = _teacher_forced(tiny_model, tokens, 200, torch.float32)
    spread = want.std().item()
    rows = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8)):
        got = _teacher_forced(tiny_model, tokens, 200, dtype)
        d = (got - want).float()
        top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        rows.append((name, d.pow(2).mean(-1).sqrt().median().item() / spread, d.abs().max().item(), top1))
    print("\nKV dtype vs fp32 KV (tiny, 41 teacher-forced positions): median rms dlogit / logit std, "
          "max |dlogit|, top-1")
    for r in rows:
        print("  %-5s %.4f  %.3f  %.3f" % r)
    (_, bf_rms, _, bf_top), (_, f8_rms, _, f8_top) = rows
    assert bf_rms < 0.01 and bf_top >= 0.95
    assert bf_rms < f8_rms < 0.1 and f8_top >= 0.85


def test_fp8_kv_engine_greedy_vs_fp32_and_bf16_kv_no_leaks(ckpt_factory):
    """The whole engine (scheduler, chunked prefill past the sliding ring, batched decode) with FP8
    pages: it runs, every page comes back, and its greedy tokens are reported against fp32/bf16 KV
    (random weights have near-ties, so free-running outputs drift apart after the first flip)."""
    path = ckpt_factory("tiny")
    prompts = _prompts([5, 40, 300], seed=2)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for name, kw in (("fp32", {}), ("bf16", {"kv_cache_dtype": "bf16"}),
                     ("fp8-cal", {"kv_cache_dtype": "fp8", "kv_scale_calibration": 1})):
        llm = LLM(EngineConfig(checkpoint=path, kv_cache_bytes=16 << 20,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=1024),
                               **kw))
        assert llm.engine.runner.pool.spec.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}.get(name, FP8)
        tag = llm.engine.runner.pool.scales_tag
        assert tag.startswith("calibrated:1:") if name == "fp8-cal" else tag == "none"
        outs[name] = [c.output_ids for c in llm.generate(prompts, params)]
        llm.kv.assert_all_free()

    def same_prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))

    print("\ngreedy tokens equal to fp32 KV before the first difference (of 16), per prompt:")
    for name in ("bf16", "fp8-cal"):
        print(f"  {name:8s}", [same_prefix(a, b) for a, b in zip(outs[name], outs["fp32"])])
    assert all(len(o) == 16 for v in outs.values() for o in v)
    assert any(same_prefix(a, b) > 0 for a, b in zip(outs["fp8-cal"], outs["fp32"]))


def test_fp8_kv_engine_tokens_triton_equal_torch(ckpt_factory, one_torch_thread, monkeypatch):
    """tiny-a (window 4, page 4): chunked prefill, sliding rings, decode; Triton under the
    interpreter reads and writes the same e4m3 pages as the reference."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = ckpt_factory("tiny-a")
    prompts = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(3)).tolist() for n in (19, 1, 6)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(EngineConfig(checkpoint=path, attention_backend=backend, page_size=4, kv_cache_bytes=1 << 20,
                               kv_cache_dtype="fp8",
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)))
        outs[backend] = [c.output_ids for c in llm.generate(prompts, params)]
        llm.kv.assert_all_free()
    assert outs["triton"] == outs["torch"]


# ---- serving: prefill and decode processes, KV over NIXL ------------------------------------------------
nixl = pytest.importorskip("nixl._api", reason="NIXL is not installed")


@pytest.fixture
def _ucx_over_tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("NIXL_LOG_LEVEL", "WARN")


def test_fp8_kv_disaggregated_equals_colocated(ckpt_factory, _ucx_over_tcp):
    """Both workers calibrate their FP8 scales at start-up on the same prompts, so their tables (and
    the handshake's tags) agree; the disaggregated tokens equal the single-process FP8 engine's,
    each request on its own like the service runs them (batch composition moves fp32 results in the
    last bits, and an e4m3 rounding boundary can turn that into a different code)."""
    from openai import OpenAI

    from tests.support.service import start_service

    path = ckpt_factory("tiny")
    prompts = _prompts([7, 150, 40], seed=4)
    llm = LLM(EngineConfig(checkpoint=path, kv_cache_bytes=64 << 20, kv_cache_dtype="fp8", kv_scale_calibration=1))
    want = [llm.generate([p], SamplingParams(max_tokens=12, temperature=0))[0].output_ids for p in prompts]
    svc = start_service(path, kv_cache_dtype="fp8", kv_scale_calibration=1)
    try:
        client = OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for p, w in zip(prompts, want):
            r = client.completions.create(model="m", prompt=p, max_tokens=12, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == w
        svc.assert_no_leaks()
    finally:
        svc.stop()


def test_fp8_kv_pages_land_byte_exact_over_nixl(_ucx_over_tcp):
    from tests.support.nixl_cluster import Cluster, Scenario, _assert_done

    sc = Scenario(p=1, d=2, kv_dtypes=("fp8", "fp8"))
    with Cluster(sc) as c:
        c.wire()
        results = c.results()
    _assert_done(results, sc)


def test_fp8_kv_handshake_refuses_a_bf16_prefill_over_nixl(_ucx_over_tcp):
    from kv_transfer.interface import FailureReason
    from tests.support.nixl_cluster import Cluster, Scenario

    sc = Scenario(kv_dtypes=("bf16", "fp8"), prefill_page_size=8)
    with Cluster(sc) as c:
        c.wire()
        results = c.results()
    pr, dr = results[("prefill", 0)], results[("decode", 0)]
    assert pr.status == dr.status == "FAILED", results
    assert pr.reason == dr.reason == FailureReason.HANDSHAKE_MISMATCH.name, results
    assert "dtype: 'bfloat16' here vs 'float8_e4m3fn' at the peer" in pr.detail, pr.detail
    assert "kv_scales: 'none' here vs 'default' at the peer" in pr.detail, pr.detail
    assert pr.all_free and dr.all_free and dr.seconds_to_terminal < sc.deadline_s / 2
