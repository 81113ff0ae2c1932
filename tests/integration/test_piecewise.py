"""Piecewise forward (engine/piecewise.py) on the CPU: the pieces run directly on the static buffers
(no capture), padded to a bucket, against the monolithic GptOss.forward, bit for bit in fp32:

  * fused norms (Triton norms, attention and grouped MoE in the interpreter, rope_store): the
    `pending` MoE output handed from piece to piece, padded rows that never reach real rows (bit for
    bit); exact buckets bit for bit, padded steps within fp32 rounding (the interpreter's GEMMs may
    round a row by the row count of its GEMM: numpy on an AVX-512 Xeon differs at some counts);
  * torch backends (unfused norms) at exact buckets: the reference MoE's per-expert GEMMs and the
    dense GEMMs change kernels with their row counts (MKL takes another path at M <= 3), so padded
    rows there are compared within fp32 rounding;
  * on_layer_done(i) runs in order, after layer i stored its K/V and before layer i + 1 did;
  * bucket choice; steps above the largest bucket run the eager forward; the engine flag end to end.
The GPU twin (captured graphs, bf16, 20b widths) is tests/integration/test_piecewise_gpu.py."""

import pytest
import torch

from engine.build import EngineConfig, make_piecewise
from engine.llm import LLM
from engine.piecewise import DEFAULT_BUCKETS, PiecewiseGraphs, PiecewiseSplit, buckets_for
from engine.sampling import SamplingParams
from kernels.registry import make_backends
from engine.scheduler import SchedulerConfig
from model.config import preset
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_cache import KVManager, KVPool, PageGroup, SeqPages, plan_kv_cache
from model.kv_scales import KVScales
from model.loader import load_weights
from model.weights import SafetensorsSource


def _model(path: str, fused: bool) -> GptOss:
    src = SafetensorsSource(path)
    if fused:  # FP8 experts on the grouped Triton MoE with one tile table for every token count
        from kernels.moe import TritonMoE
        from kernels.tuning import default_moe_config

        be = make_backends("triton", "torch", "triton", "rope_store")
        be.moe = TritonMoE(config=default_moe_config(4, fp8=True))
        model = GptOss(src.config, be, dtype=torch.float32, fp8=True)
    else:
        model = GptOss(src.config, make_backends("torch", "torch", "torch", "off"), dtype=torch.float32)
    load_weights(model, src, progress=False)
    return model


def _layer_kv(pool: KVPool, layer: int) -> list[torch.Tensor]:
    return [t.clone() for t in pool.layer_kv(layer)]


def _run_steps(model: GptOss, buckets: tuple[int, ...], chunks: tuple[int, ...], exact: bool) -> None:
    """One sequence fed in `chunks`: the eager forward on one pool, the pieces on another; hidden
    states and every page equal after each step (exact; with exact="bucket" only at steps that fill
    their bucket, padded ones within fp32 rounding) or close (not exact)."""
    spec = plan_kv_cache(model.cfg, 1 << 20, page_size=4, max_num_seqs=2, dtype=torch.float32)
    mgr = KVManager(spec)
    ref_pool, pw_pool = KVPool(spec), KVPool(spec)
    pw = PiecewiseGraphs(model, buckets)
    pages = SeqPages()
    layers = len(model.layers)
    ids = torch.randint(0, model.cfg.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(0))
    pos, diverged = 0, False
    for n in chunks:
        # once a step matched only within rounding, later steps attend over those K/V: within rounding too
        step_exact = exact is True or (exact == "bucket" and pw.bucket(n) == n and not diverged)
        diverged = diverged or not step_exact
        mgr.grow(pages, pos + n)
        meta = build_step_meta([SeqStep(pages, pos, n)], spec)
        want = model(ids[pos:pos + n], meta, ref_pool)
        before = [_layer_kv(pw_pool, i) for i in range(layers)]
        seen: list[int] = []

        def hook(i: int) -> None:  # layer i stored, layer i + 1 not yet
            seen.append(i)
            got, ref = _layer_kv(pw_pool, i), _layer_kv(ref_pool, i)
            if step_exact:
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (n, i)
            else:
                for a, b in zip(got, ref):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if i + 1 < layers:
                assert all(torch.equal(a, b) for a, b in zip(_layer_kv(pw_pool, i + 1), before[i + 1])), (n, i)
                assert not all(torch.equal(a, b) for a, b in zip(_layer_kv(ref_pool, i + 1), before[i + 1]))

        got = pw.run(ids[pos:pos + n], meta, pw_pool, hook)
        assert seen == list(range(layers))
        assert got.shape == want.shape
        if step_exact:
            assert torch.equal(got, want), (n, (got - want).abs().max())
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        pos += n


def test_piecewise_fused_norms_padded(ckpt_factory, one_torch_thread):
    """tiny-a (window 4, page 4): exact buckets first (decodes in bucket 1, a 16-token chunk, an 8-token
    chunk past the window: the sliding layers' prefix-plus-chunk path), bit for bit; then a 13-token
    chunk in bucket 16, decodes, a 6-token chunk and a 5-token chunk in bucket 8 within fp32 rounding
    (from the first padded step on: later steps attend over its K/V). Padded steps: with padding
    the MoE's experts get other row counts and the interpreter's block GEMMs (numpy's BLAS) may round
    a real row differently by the row count of its GEMM: bit-equal on the CI machine of 2026-12-02, one ulp
    apart at 5-in-8 on an AVX-512 Xeon (2026-12-03). That padding never reaches real rows is checked
    bit for bit below (test_piecewise_padding_never_reaches_real_rows)."""
    model = _model(ckpt_factory("tiny-a"), fused=True)
    assert model.backends.fused_norm and model.backends.fused_rope_store
    _run_steps(model, (1, 8, 16, 32), (1, 1, 16, 1, 8, 13, 1, 6, 1, 5), exact="bucket")


def test_piecewise_padding_never_reaches_real_rows(ckpt_factory, one_torch_thread):
    """The same real tokens with other contents in the padded rows (stale ids, a stale residual
    stream and attention output): the real rows' hidden states keep their bits."""
    model = _model(ckpt_factory("tiny-a"), fused=True)
    spec = plan_kv_cache(model.cfg, 1 << 20, page_size=4, max_num_seqs=2, dtype=torch.float32)
    mgr = KVManager(spec)
    pages = SeqPages()
    mgr.grow(pages, 9)
    meta = build_step_meta([SeqStep(pages, 0, 9)], spec)
    ids = torch.randint(0, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    pw = PiecewiseGraphs(model, (16,))
    outs = []
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        with torch.inference_mode():  # the static buffers are inference tensors
            pw.ids.random_(0, model.cfg.vocab_size, generator=g)
            pw.o.normal_(generator=g)
            pw.x.normal_(generator=g)
        outs.append(pw.run(ids, meta, KVPool(spec)).clone())
    assert torch.equal(outs[0], outs[1])


def test_piecewise_torch_backends(ckpt_factory):
    """Unfused norms (the CPU engine's path): exact buckets bit for bit, padded ones within rounding."""
    model = _model(ckpt_factory("tiny-a"), fused=False)
    assert not model.backends.fused_norm
    _run_steps(model, (1, 6, 13), (13, 1, 6, 1), exact=True)
    _run_steps(model, (16, 32), (13, 1, 6, 1, 20), exact=False)


def test_piecewise_bucket_choice():
    assert buckets_for(8192) == DEFAULT_BUCKETS
    assert buckets_for(100) == (16, 32, 64)
    assert buckets_for(8) == (8,)
    model = GptOss(preset("tiny-a"), make_backends())
    pw = PiecewiseGraphs(model, (64, 16, 32))
    assert pw.buckets == (16, 32, 64)
    assert [pw.bucket(t) for t in (0, 1, 16, 17, 33, 64, 65)] == [None, 16, 16, 32, 64, 64, None]
    assert pw.x.shape == (64, model.cfg.hidden_size) and pw.ids.shape == (64,)
    pw.capture()  # no CUDA: nothing captured, the pieces run directly
    assert pw.graphs == {}


def test_piecewise_runner_falls_back_above_largest_bucket(ckpt_factory, monkeypatch):
    """ModelRunner.forward: a step within the buckets runs the pieces, a larger one the eager forward,
    with the same logits in either case."""
    cfg = EngineConfig(checkpoint=ckpt_factory("tiny-a"), kv_cache_bytes=1 << 20, piecewise_graphs=True,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256))
    llm = LLM(cfg)
    runner = llm.engine.runner
    assert runner.piecewise is not None and runner.piecewise.buckets == (16, 24, 32)  # fine, the default
    calls = []
    real_run = runner.piecewise.run
    monkeypatch.setattr(runner.piecewise, "run", lambda *a, **k: calls.append(a[0].shape[0]) or real_run(*a, **k))
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = llm.engine.kv
    logits = {}
    for n in (20, 40):  # 20 -> bucket 24; 40 > 32 -> eager
        pages = SeqPages()
        kv.grow(pages, n)
        try:
            out = runner.forward(ids[:n], [SeqStep(pages, 0, n)], [0])
            runner.piecewise, saved = None, runner.piecewise
            ref = runner.forward(ids[:n], [SeqStep(pages, 0, n)], [0])
            runner.piecewise = saved
        finally:
            kv.release(pages)
        logits[n] = (out, ref)
    assert calls == [20]
    torch.testing.assert_close(*logits[20], rtol=1e-5, atol=1e-5)
    assert torch.equal(*logits[40])
    kv.assert_all_free()


def test_piecewise_engine_flag_same_tokens(ckpt_factory):
    """The engine with the flag (chunked prefills, mixed steps, decode steps through the pieces) gives
    the greedy tokens of the engine without it; every page comes back."""
    path = ckpt_factory("tiny-a")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 70)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = {}
    # "all": every layer's attention inside the pieces too (the Triton kernel, interpreted; "sliding" is the
    # same code on one group: test_piecewise_attention_inside_the_graphs)
    # "all<=24": attention inside the graphs for steps of up to 24 tokens only, islands above (PiecewiseSplit)
    for flag in (False, True, "all", "all<=24"):
        llm = LLM(EngineConfig(checkpoint=path, kv_cache_bytes=1 << 20, piecewise_graphs=bool(flag),
                               piecewise_graphed=flag[:3] if isinstance(flag, str) else "none",
                               piecewise_graphed_max_tokens=24 if flag == "all<=24" else 0,
                               scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                         max_model_len=256)))
        pw = llm.engine.runner.piecewise
        assert (pw is not None) == bool(flag)
        if flag == "all<=24":
            assert isinstance(pw, PiecewiseSplit) and pw.small.buckets == (16, 24) and not pw.small.islands
            assert pw.large.buckets == (32, 48, 64) and len(pw.large.islands) == 4
            sizes = {"small": [], "large": []}
            for name in sizes:
                part = getattr(pw, name)
                real = part.run
                part.run = lambda *a, _r=real, _n=name, **k: sizes[_n].append(a[0].shape[0]) or _r(*a, **k)
        else:
            assert pw is None or len(pw.islands) == {True: 4, "all": 0}[flag]
        outs[flag] = [o.output_ids for o in llm.generate(prompts, params)]
        llm.kv.assert_all_free()
    assert outs[True] == outs[False] == outs["all"] == outs["all<=24"]
    # a limit below every bucket: islands throughout (no graphed set at all)
    low = make_piecewise(EngineConfig(checkpoint=path, piecewise_graphs=True, piecewise_graphed="all",
                                      piecewise_graphed_max_tokens=8,
                                      scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)),
                         llm.engine.model, llm.engine.runner.pool)
    assert isinstance(low, PiecewiseGraphs) and len(low.islands) == 4 and not low.tables
    assert sizes["small"] and max(sizes["small"]) <= 24 and sizes["large"] and min(sizes["large"]) > 24, sizes


def _run_graphed_steps(model: GptOss, buckets: tuple[int, ...], steps: list[list[tuple[int, int]]],
                       graphed: frozenset[PageGroup], kv_dtype: torch.dtype = torch.float32) -> None:
    """Several sequences per step ((sequence, new tokens) pairs): the eager forward (TritonAttention) on
    one pool, the pieces with the `graphed` groups' attention inside them (kernels/triton_graph_attention.py)
    on another; hidden states and every page equal after each step: bit for bit while every step fills
    its bucket, within fp32 rounding from the first padded step on (the interpreter's GEMMs may round a
    row by its GEMM's row count: test_piecewise_fused_norms_padded)."""
    spec = plan_kv_cache(model.cfg, 1 << 20, page_size=4, max_num_seqs=4, dtype=kv_dtype)
    mgr = KVManager(spec)
    scales = None
    if kv_dtype == torch.float8_e4m3fn:  # per layer and head, not 1.0: the dequantisation must be applied
        n, h = model.cfg.num_hidden_layers, model.cfg.num_key_value_heads
        steps_k = torch.arange(n * h, dtype=torch.float32).reshape(n, h) % 3
        scales = KVScales(torch.exp2(steps_k - 2), torch.exp2(1 - steps_k), "test")
    ref_pool, pw_pool = KVPool(spec, scales=scales), KVPool(spec, scales=scales)
    pw = PiecewiseGraphs(model, buckets, pool=pw_pool, graphed=graphed, max_seqs=4, max_model_len=64)
    assert pw.islands == [i for i, blk in enumerate(model.layers) if blk.attn.group not in graphed]
    pages = [SeqPages() for _ in range(4)]
    pos = [0] * 4
    gen = torch.Generator().manual_seed(5)
    exact = True
    for step in steps:
        seq_steps = []
        for s, n in step:
            mgr.grow(pages[s], pos[s] + n)
            seq_steps.append(SeqStep(pages[s], pos[s], n))
        t = sum(n for _, n in step)
        exact = exact and pw.bucket(t) == t
        ids = torch.randint(0, model.cfg.vocab_size, (t,), generator=gen)
        meta = build_step_meta(seq_steps, spec)
        want = model(ids, meta, ref_pool)
        seen: list[int] = []
        got = pw.run(ids, meta, pw_pool, seen.append)
        assert sorted(seen) == list(range(len(model.layers)))
        pairs = [(got, want)] + [(a, b) for i in range(len(model.layers))
                                 for a, b in zip(pw_pool.layer_kv(i), ref_pool.layer_kv(i))]
        for a, b in pairs:
            if exact:
                assert torch.equal(a, b), (step, (a - b).abs().max())
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for s, n in step:
            pos[s] += n


STEPS = [
    [(0, 9)],  # one chunk past the window (the prefix-plus-chunk path from the second chunk on)
    [(0, 1)],  # a decode: the ring holds everything (store first, read every key from the pages)
    [(1, 12), (0, 1)],  # a chunk beside a decode row
    [(0, 1), (1, 1), (2, 7)],  # two decode rows and a third sequence's first chunk
    [(1, 10), (2, 9)],  # two chunks past the ring, with prefixes
]


def test_piecewise_attention_inside_the_graphs_e4m3_pages(ckpt_factory, one_torch_thread):
    """The same steps on e4m3 pages with per-head scales (--kv-cache-dtype fp8 with --piecewise-graphed-attention
    all): the quantising store and the dequantising read inside the pieces give the eager Triton backend's bits,
    page for page (its generic kernel on
    decode rows too, as in the graphs: the decode kernel it picks for e4m3 pages by default sums in another order)."""
    from kernels.triton_attention_backend import DecodeKernel, TritonAttention

    model = _model(ckpt_factory("tiny-a"), fused=True)
    model.backends.attention = TritonAttention(decode=DecodeKernel.OFF)
    _run_graphed_steps(model, tuple(sorted({sum(n for _, n in st) for st in STEPS})), STEPS, frozenset(PageGroup),
                       torch.float8_e4m3fn)


@pytest.mark.parametrize("graphed", ["sliding", "all"])
def test_piecewise_attention_inside_the_graphs(ckpt_factory, one_torch_thread, graphed):
    """tiny-a (window 4, page 4): chunks larger than the ring, decodes, and mixed steps of decode rows
    beside chunks over several sequences, with the sliding layers' attention (or every layer's: the step
    is one piece) inside the pieces: with every step in a bucket of its size the same bits as the eager
    forward on the Triton attention backend; in padded buckets within fp32 rounding."""
    model = _model(ckpt_factory("tiny-a"), fused=True)
    groups = frozenset({PageGroup.SLIDING}) if graphed == "sliding" else frozenset(PageGroup)
    _run_graphed_steps(model, tuple(sorted({sum(n for _, n in st) for st in STEPS})), STEPS, groups)
    if graphed == "sliding":
        _run_graphed_steps(model, (4, 16, 32), STEPS[:3], groups)
