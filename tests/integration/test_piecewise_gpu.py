"""Piecewise CUDA graphs on the GPU (engine/piecewise.py; gpt-oss-20b widths, random weights, 4 layers,
every attention call an island, then the sliding layers' attention inside the pieces, then every layer's
(--piecewise-graphed-attention sliding|all: those run Triton attention kernels, so they are judged against the
eager forward on the Triton attention backend without split-KV, and against FlashInfer's eager forward no further
than the two eager backends are apart),
bf16 with FP8 experts on the worker's default MoE backend, FlashInfer, the worker's linear): the
captured pieces against the eager forward, per step size (T = 1, 17, 352, 1000, a 352-token chunk
after a 1000-token prefix, a mixed step of decode rows and a chunk): hidden states, logits and the
stored K/V within bf16 noise, greedy first tokens equal unless the eager logits are a near-tie there;
hooks once per layer in order; steps above the largest bucket eager; no leaked pages. Run through the
device tool (suite `piecewise-ab`); $OUT/piecewise_gpu.json gets the numbers.

Why fixed bounds: the eager and the graphed forward run the same kernels on the same real rows, except
that GEMMs and the MoE see B >= T rows (cuBLAS may pick another algorithm, the MoE another tile table
or path), so they differ by bf16 rounding only (~1e-3 relative per layer); a piece wired wrong
(a missing residual, a layer's weights swapped, padded rows leaking) is off by O(1)."""

import json
import os
import time
from pathlib import Path

import pytest
import torch

from engine.build import EngineConfig, build_engine_parts
from engine.piecewise import FINE_BUCKETS, buckets_for
from engine.scheduler import SchedulerConfig
from model.context import SeqStep, build_step_meta
from model.kv_cache import SeqPages

pytestmark = pytest.mark.gpu

# TANDEM_PW_LAYERS=2 (suite launch-hold-ab): fewer random layers amplify rounding less, which tells a
# kernel's rounding (grows with depth) from a fault (large from the first layer on)
LAYERS = int(os.environ.get("TANDEM_PW_LAYERS", "4"))
REL_BOUND = 3e-2  # hidden, logits, K/V: relative Frobenius error, piecewise vs eager
TIE = 0.25  # two bf16 steps at the random model's top logits (~16-20): a near-tie below this margin
BUILD_S: list[float] = []


@pytest.fixture(scope="module", params=["none", "sliding", "all", "all-e4m3"])
def parts(request):
    """The engine with every attention call an island, then with the sliding layers' or every layer's
    attention captured inside the pieces (--piecewise-graphed-attention: kernels/triton_graph_attention.py), then
    every layer's on e4m3 pages (--kv-cache-dtype fp8: the quantising store and the dequantising read in the
    graphs; a decode worker over e4m3 pages keeps islands by default until this engine passes)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from kernels.registry import auto_moe_backend

    graphed, _, kv = request.param.partition("-")
    cfg = EngineConfig(random_preset="gpt-oss-20b", random_layers=LAYERS, device="cuda", dtype="bfloat16", fp8=True,
                       kv_cache_dtype="fp8" if kv == "e4m3" else "auto", fp8_attention=False,
                       attention_backend="flashinfer", linear_backend="scaled_mm",
                       moe_backend=auto_moe_backend("cuda", True, True), kv_cache_bytes=2 << 30,
                       enable_prefix_caching=False, piecewise_graphs=True, piecewise_graphed=graphed,
                       # attention in the graphs at every bucket (one PiecewiseGraphs; the served default of 768
                       # splits steps between a graphed and an islands set, engine.piecewise.PiecewiseSplit)
                       piecewise_graphed_max_tokens=0,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=4096))
    # the graphed tables without split-KV, as the eager Triton reference runs (_unsplit_triton): a split changes
    # fp32 merge rounding, which 4 random layers amplify past the bound; the splits' own accuracy is checked per
    # kernel (test_attention_gpu.py's long-context graph replay, benchmarks/graph_attention_long.py)
    import kernels.triton_graph_attention as tga

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tga, "graph_splits", lambda *a, **k: {})
        t0 = time.monotonic()
        p = build_engine_parts(cfg)
        BUILD_S.append(time.monotonic() - t0)  # load + KV + capture
    yield p
    del p  # the next parametrisation builds its own engine


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _e4m3(pool) -> bool:
    return pool.spec.dtype == torch.float8_e4m3fn


def _unsplit_triton(e4m3: bool):
    """The eager Triton backend without split-KV: the graphed attention's kernels and tile configs for chunks, which
    split only past GPU_SPLITS' 1024-key pieces (none here), where the eager backend splits a 352-token prompt in
    two to fill the SMs (kernel-defaults-check-1 read that as 0.057 between the two at T=352). On e4m3 pages its
    generic kernel reads decode rows too, as the graphs do (its default decode kernel for them sums in another order:
    tests/integration/test_piecewise.py's e4m3 test does the same on the CPU)."""
    from kernels.triton_attention_backend import DecodeKernel, TritonAttention
    return TritonAttention(num_splits=1, decode=DecodeKernel.OFF) if e4m3 else TritonAttention(num_splits=1)


def _eager_on_triton(model, tok, meta, pool, saved) -> torch.Tensor:
    """The eager forward with the Triton attention backend, from the same cache state (restored after)."""
    after = [t.clone() for t in pool.pools]
    for t, s in zip(pool.pools, saved):
        t.copy_(s)
    be = model.backends
    fi, be.attention = be.attention, _unsplit_triton(_e4m3(pool))
    try:
        out = model(tok, meta, pool).clone()  # [T, H]
    finally:
        be.attention = fi
        for t, a in zip(pool.pools, after):
            t.copy_(a)
    return out


def _rel_written(got: list[torch.Tensor], want: list[torch.Tensor], before: list[torch.Tensor]) -> float:
    """Relative error over the cache elements either run wrote (a store into a wrong slot counts)."""
    num = den = 0.0
    for a, b, s in zip(got, want, before):
        bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)  # e4m3: no !=
        m = (bits(a) != bits(s)) | (bits(b) != bits(s))
        num += float((a[m].float() - b[m].float()).norm()) ** 2
        den += float(b[m].float().norm()) ** 2
    assert den > 0, "the step stored nothing"
    return (num / den) ** 0.5


def test_piecewise_gpu_matches_eager(parts):
    model, pool, kv, runner = parts.model, parts.pool, parts.kv, parts.runner
    pw = runner.piecewise
    assert pw is not None and pw.buckets == buckets_for(2048, FINE_BUCKETS)  # the default spacing
    graphed = sorted(int(g) for g in pw.tables)
    assert len(pw.islands) == {0: LAYERS, 1: LAYERS // 2, 2: 0}[len(graphed)]
    assert sorted(pw.graphs) == list(pw.buckets) and all(len(g) == len(pw.islands) + 1 for g in pw.graphs.values())
    free0 = kv.num_free()
    g = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    seqs = [SeqPages() for _ in range(4)]
    ids = [torch.randint(1000, vocab - 1000, (1400,), generator=g).tolist() for _ in seqs]
    # (name, [(seq index, start, q_len)]): sequence 0 is prefilled by the T=1000 step, then continued
    cases = [("T=1", [(1, 0, 1)]), ("T=17", [(2, 0, 17)]), ("T=352", [(3, 0, 352)]), ("T=1000", [(0, 0, 1000)]),
             ("352 after 1000", [(0, 1000, 352)]),
             ("mixed 2 decode + 40", [(0, 1352, 1), (2, 17, 1), (1, 1, 40)])]
    e4m3 = _e4m3(pool)
    report = {"graphed_groups": graphed, "kv_dtype": str(pool.spec.dtype), "build_and_capture_s": BUILD_S[-1], "static_mib": pw.static_bytes() / 2**20, "pool_mib": pw.pool_bytes() / 2**20,
              "reserved_gib": torch.cuda.memory_reserved() / 2**30, "cases": {}}
    try:
        for name, spec in cases:
            steps = []
            for s, start, q in spec:
                kv.grow(seqs[s], start + q)
                steps.append(SeqStep(seqs[s], start, q))
            tok = torch.tensor([t for s, start, q in spec for t in ids[s][start:start + q]], device="cuda")
            meta = build_step_meta(steps, pool.spec, model.device)
            saved = [t.clone() for t in pool.pools]  # the eager run must read the prefix the piecewise run read
            seen: list[int] = []
            hidden = pw.run(tok, meta, pool, seen.append).clone()  # [T, H]
            kv_pw = [t.clone() for t in pool.pools]
            for t, s in zip(pool.pools, saved):
                t.copy_(s)
            ref = model(tok, meta, pool).clone()
            ref_triton = _eager_on_triton(model, tok, meta, pool, saved) if graphed else None
            assert seen == list(range(LAYERS)), (name, seen)
            last = meta.logits_indices
            lp, le = model.compute_logits(hidden[last]), model.compute_logits(ref[last])  # [B, V] fp32
            gap = (le.max(dim=1).values - le.gather(1, lp.argmax(dim=1, keepdim=True)).squeeze(1)).tolist()
            diff = float((lp - le).abs().max())
            row = {"T": int(tok.shape[0]), "bucket": pw.bucket(tok.shape[0]), "hidden_rel": _rel(hidden, ref),
                   "logits_rel": _rel(lp, le), "logits_max_abs": diff,
                   "kv_rel": _rel_written(kv_pw, list(pool.pools), saved),
                   "same_first_token": (lp.argmax(dim=1) == le.argmax(dim=1)).tolist(), "eager_gap": gap}
            if ref_triton is not None:
                # attention in the graphs runs the Triton kernels, eager runs FlashInfer: judged against the eager
                # forward on the Triton backend (the same kernels: the bound holds), and against FlashInfer no
                # further than the two eager backends are from each other (rounding, amplified by random layers)
                row["hidden_rel_vs_eager_triton"] = _rel(hidden, ref_triton)
                row["eager_triton_vs_flashinfer"] = _rel(ref_triton, ref)
            report["cases"][name] = row
            print(name, row)
            if ref_triton is None:
                assert row["hidden_rel"] < REL_BOUND and row["logits_rel"] < REL_BOUND and row["kv_rel"] < REL_BOUND, row
            else:
                # `all` runs every layer's attention as eager Triton does; `sliding` keeps FlashInfer islands on the
                # full layers, between the two eager backends
                apart = max(REL_BOUND, 1.5 * row["eager_triton_vs_flashinfer"] + 0.01)
                # on e4m3 pages a rounding-level difference (the bucket's GEMMs and MoE see B >= T rows) moves K/V by
                # whole e4m3 steps: graph-tests-4 read 0.034 at T=1 against eager Triton, where the two eager backends
                # were 0.039 apart; judged as the sliding arm is, no further than the eager backends are apart
                strict = not pw.islands and not e4m3
                assert row["hidden_rel_vs_eager_triton"] < (REL_BOUND if strict else apart), row
                assert row["hidden_rel"] < apart, row
            # a different greedy token only where the eager logits are a near-tie there
            assert all(same or gp <= max(TIE, 2 * diff) for same, gp in zip(row["same_first_token"], gap)), row
    finally:
        for s in seqs:
            kv.release(s)
        if os.environ.get("OUT"):
            name = (f"piecewise_gpu_graphed{len(graphed)}" if graphed else "piecewise_gpu") + ("_e4m3" if e4m3 else "") \
                + ("" if LAYERS == 4 else f"_{LAYERS}layers") + ".json"
            Path(os.environ["OUT"], name).write_text(json.dumps(report, indent=1) + "\n")
    assert kv.num_free() == free0 == tuple(parts.spec.num_pages)


def test_piecewise_gpu_runner_paths_and_speed(parts):
    """ModelRunner.forward: T <= 2048 replays the pieces, T > 2048 runs the eager forward (same logits
    as with the flag off); wall time of a 352-token step both ways (printed, not asserted: the A/B
    is benchmarks/prefill_prefix.py's)."""
    runner, kv = parts.runner, parts.kv
    pw = runner.piecewise
    calls: list[int] = []
    real = pw.run
    pw.run = lambda ids, *a, **k: calls.append(int(ids.shape[0])) or real(ids, *a, **k)
    g = torch.Generator().manual_seed(1)
    timing = {}
    try:
        for n in (352, 2500):
            pages = SeqPages()
            kv.grow(pages, n)
            prompt = torch.randint(1000, 100_000, (n,), generator=g).tolist()
            try:
                with_pw = runner.forward(prompt, [SeqStep(pages, 0, n)], [0])
                runner.piecewise = None
                eager = runner.forward(prompt, [SeqStep(pages, 0, n)], [0])
                if n > 2048:
                    assert torch.equal(with_pw, eager)  # both eager
                elif not pw.tables:
                    assert _rel(with_pw, eager) < REL_BOUND
                else:  # attention in the graphs: against the same kernels run eagerly (all) or as the matches test
                    be = runner.model.backends
                    fi, be.attention = be.attention, _unsplit_triton(_e4m3(parts.pool))
                    try:
                        eager_triton = runner.forward(prompt, [SeqStep(pages, 0, n)], [0])
                    finally:
                        be.attention = fi
                    apart = _rel(eager_triton, eager)
                    timing[f"T={n} eager triton vs flashinfer"] = apart
                    if not pw.islands:
                        assert _rel(with_pw, eager_triton) < REL_BOUND
                    assert _rel(with_pw, eager) < max(REL_BOUND, 1.5 * apart + 0.01)
                runner.piecewise = pw
                for mode in ("piecewise", "eager"):
                    runner.piecewise = pw if mode == "piecewise" else None
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        runner.forward(prompt, [SeqStep(pages, 0, n)], [0])
                    torch.cuda.synchronize()
                    timing[f"{mode} T={n} ms"] = (time.perf_counter() - t0) / 5 * 1e3
                runner.piecewise = pw
            finally:
                kv.release(pages)
    finally:
        runner.piecewise = pw
        del pw.run  # the method again
    print("step wall time (4 layers):", timing)
    assert calls and set(calls) == {352}
    assert kv.num_free() == tuple(parts.spec.num_pages)
