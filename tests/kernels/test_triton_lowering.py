"""The GPU-only branches of our Triton kernels compile, checked on CPU.

The interpreter runs each kernel with its CPU constexprs (HW_CVT=False: e4m3 emulated in fp32;
DOT_F32=True), so the branches a GPU takes are never built by the CPU tests: a type error there
(session 8's `cast_e4m3` early return, fp8 vs fp32) broke every FP8 quantisation on the H200 while
CI passed. Here each kernel is launched once on tiny inputs through its real wrapper under the
interpreter, the launches are recorded (benchmarks.sass_probe.recording: argument types, constexprs,
the launcher's divisibility specialisation, warps, stages), the GPU constexprs are substituted and every
launch is compiled for sm_90a down to a cubin (Triton's own ptxas) in a subprocess without the
interpreter, and its shared memory checked against the SM90 limit. This machine's Triton (3.9) is newer
than the H200 image's (3.6), so a kernel can still differ there; register spills need a GPU to read back. Not covered: kernels/allreduce.py (needs multi-GPU symmetric
memory even to launch). Constexprs are those of the tiny CPU shapes, not the tuned real-size tiles."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from benchmarks.sass_probe import build_sm90, recording  # noqa: E402
from tests.kernels.test_moe import _experts, _logits  # noqa: E402

SMEM_LIMIT = 232448  # H100/H200 dynamic shared memory per block (227 KB)


def _launch_every_kernel() -> None:
    """One call through each wrapper that owns a Triton kernel, on tiny CPU inputs."""
    from kernels import moe_align
    from kernels.fp8_gemm import TritonFp8Linear
    from kernels.fp8_quant import quantize_act_1x128
    from kernels.moe import TritonMoE
    from kernels.moe_dg import DeepGemmMoE
    from kernels.moe_small import SmallBatchMoE
    from kernels.norm import add_rms_norm, fused_norm, rms_norm
    from kernels import reference as ref

    torch.manual_seed(0)
    x = torch.randn(5, 200)
    quantize_act_1x128(x)
    quantize_act_1x128(x, k_pad=16, m_align=4, ones=(200, 3))
    w, ws = ref.quantize_fp8_blockwise(torch.randn(96, 200) * 0.1)
    TritonFp8Linear()(x.to(torch.bfloat16), w, ws, torch.randn(96).to(torch.bfloat16))
    rms_norm(x, torch.ones(200), 1e-5)
    add_rms_norm(x, x, torch.ones(200), 1e-5)
    xb5 = x.to(torch.bfloat16)  # the fused norm's router GEMV and FP8 copy (Fusion.NORM_*), in bf16 as on the GPU
    fused_norm(xb5, xb5, torch.ones(200), 1e-5, quant=True, router=(torch.randn(6, 200).to(torch.bfloat16), xb5[0, :6]))
    xb65 = torch.randn(65, 200).to(torch.bfloat16)  # past kernels.norm.QUANT_SPREAD_MAX_TOKENS: one program a row
    fused_norm(xb65, xb65, torch.ones(200), 1e-5, quant=True)
    h, i, e = 128, 128, 4
    xb = torch.randn(3, h).to(torch.bfloat16)
    logits = _logits(3, e, torch.bfloat16)
    experts = _experts(e, e, h, i, torch.bfloat16, fp8=True)
    TritonMoE()(xb, logits, 2, experts)  # 6 pairs: the few-token kernels
    x8 = torch.randn(12, h).to(torch.bfloat16)
    TritonMoE()(x8, _logits(12, e, torch.bfloat16), 2, experts)  # 24 pairs: the grouped FP8 kernels
    TritonMoE()(xb, logits, 2, _experts(e, e, h, i, torch.bfloat16, fp8=False))
    SmallBatchMoE()(xb, logits, 2, experts)
    from kernels.fp8_quant import quantize_act_1x128
    SmallBatchMoE()(xb, logits, 2, experts, quantize_act_1x128(xb))  # x quantised by the norm: gate_up routes only
    DeepGemmMoE(min_rows_per_expert=0)(xb, logits, 2, experts)  # its Triton kernels; GEMMs by reference on CPU
    from kernels import moe_dg
    tile, moe_dg.SWIGLU_TILE_EXPERT = moe_dg.SWIGLU_TILE_EXPERT, not moe_dg.SWIGLU_TILE_EXPERT
    try:  # the SwiGLU pass's other variant (issue 27)
        DeepGemmMoE(min_rows_per_expert=0)(xb, logits, 2, experts)
    finally:
        moe_dg.SWIGLU_TILE_EXPERT = tile
    ids = torch.randint(0, e, (4096, 1), dtype=torch.int32)
    moe_align.align_by_expert(ids, 0, e, 64)  # the many-program path (>= 4096 pairs)
    from kernels.sampling import fused_sample, noise_bits
    seeds, pos = torch.tensor([1, 2]), torch.tensor([3, 4])
    fused_sample(torch.randn(2, 3000), torch.ones(2), seeds, pos, torch.tensor([True, False]), programs_per_sm=2)
    noise_bits(seeds, pos, 3000)
    # the few-token linear (Fusion.FEW_TOKEN_LINEAR): split-K partials + reduce, and the one-launch path,
    # at the default tiles (64 x 128, 4 stages: the shared memory that matters) and a small one
    from kernels.gemv import GemvConfig, few_token_linear
    xg, wg = torch.randn(3, 300).to(torch.bfloat16), torch.randn(80, 300).to(torch.bfloat16)
    few_token_linear(xg, wg, torch.randn(80).to(torch.bfloat16), GemvConfig(split=3))
    few_token_linear(xg, wg, None, GemvConfig(block_n=32, block_k=64, split=1))
    few_token_linear(xg[:1], wg, torch.randn(80).to(torch.bfloat16))  # one token: whole rows per program
    # the few-token FP8 projection (Fusion.FEW_TOKEN_FP8)
    from kernels.dense_small import FewTokenFp8Linear
    FewTokenFp8Linear()(x.to(torch.bfloat16)[:1], w, ws, None)
    # the one-token W8A16 projection (Fusion.FP8_ROWS): tiles by K, and others
    from kernels.fp8_rows import RowsConfig, fp8_rows_linear
    fp8_rows_linear(x.to(torch.bfloat16)[:1], w, ws, torch.randn(96).to(torch.bfloat16))
    fp8_rows_linear(x.to(torch.bfloat16)[:1], w, ws, None, RowsConfig(block_k=256, num_stages=4))
    # the one-token MoE on MXFP4 experts (kernels/moe_mxfp4.py, issue 27's experiment): default tiles and a K tail
    from benchmarks.moe_mxfp4_b1 import random_mxfp4_experts
    from kernels.moe_mxfp4 import Mxfp4Config, SmallBatchMxfp4MoE
    mx = random_mxfp4_experts(e, 128, 96, "cpu", torch.Generator().manual_seed(0))
    SmallBatchMxfp4MoE()(xb[:1], logits[:1], 2, mx)
    SmallBatchMxfp4MoE(Mxfp4Config(block_n1=8, block_n2=2, groups=2))(xb[:1], logits[:1], 2, mx)
    SmallBatchMxfp4MoE(Mxfp4Config(dot="f16_cvt", num_warps=1))(xb[:1], logits[:1], 2, mx)  # the f16x2 forms' PTX
    SmallBatchMxfp4MoE(Mxfp4Config(dot="f16_lop", num_warps=1, prefetch=True))(xb[:1], logits[:1], 2, mx)


def _launch_attention() -> None:
    from kernels.triton_store_kv import apply_rope, rope_store_kv, store_kv
    from tests.kernels.test_triton_attention import Case, _store_case

    c = Case([5, 12], [30, 4], hq=8, hkv=2, dtype=torch.bfloat16)
    c.run("dense", 0.25, None)
    c.run("prefix", 0.25, 9, num_splits=3)
    k, v, slots, kc, vc, cos, sin = _store_case(torch.bfloat16)
    store_kv(k, v, kc, vc, slots)
    rope_store_kv(k, v, kc, vc, slots, cos, sin)
    apply_rope(k, cos, sin)
    # FP8 KV: e4m3 pages read (decode with splits, prefix + dense) and written (store, RoPE + store),
    # and read back densely (gather_kv, FlashInfer's FP8 prefill)
    from kernels.triton_store_kv import gather_kv
    from tests.kernels.test_fp8_kv import Fp8Case

    f8 = Fp8Case([1, 1, 1], [30, 9, 4], hq=8, hkv=2, dtype=torch.bfloat16, seed=1)
    f8.run("all", 0.25, None, num_splits=2)
    f8.run("prefix", 0.25, 9)
    scales = (torch.full((3,), 0.5), torch.full((3,), 0.25))
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    store_kv(k, v, kc8, vc8, slots, scales)
    rope_store_kv(k, v, kc8, vc8, slots, cos, sin, scales)
    # Fusion.ROPE_STORE: q and k rotated, K/V stored, one launch (bf16 and e4m3 pages)
    from kernels.triton_store_kv import rope_qk_store_kv
    q = torch.randn(k.shape[0], 4 * k.shape[1], k.shape[2]).to(k.dtype)
    rope_qk_store_kv(q, k, v, kc, vc, slots, cos, sin, write_k=True)
    rope_qk_store_kv(q, k, v, kc8, vc8, slots, cos, sin, scales)
    gather_kv(kc8, vc8, slots.clamp(min=0), scales, torch.bfloat16)
    # the decode kernel: e4m3 pages under bf16 queries (f16 MMAs, the inline-PTX conversion, q
    # scaling; d 32: an f16 MMA's K is 16 = half the head dim), split + window; bf16 pages
    from kernels.triton_attention import AttnBatch
    from kernels.triton_decode import paged_decode
    d8 = Fp8Case([1, 1, 1], [30, 9, 4], hq=8, hkv=2, d=32, dtype=torch.bfloat16, seed=2)
    batch = AttnBatch.build(d8.q_lens, d8.kv_lens, d8.kv_lens, d8.page_table, "cpu")
    paged_decode(d8.q, (d8.k_cache, d8.v_cache), batch, d8.sinks, 0.2, None, kv_scale=d8.kv_scale)
    paged_decode(d8.q, (d8.k_cache, d8.v_cache), batch, d8.sinks, 0.2, 8, kv_scale=d8.kv_scale, num_splits=2)
    kb, vb = torch.randn(d8.k_cache.shape).to(torch.bfloat16), torch.randn(d8.v_cache.shape).to(torch.bfloat16)
    paged_decode(d8.q, (kb, vb), batch, d8.sinks, 0.2, None)
    # the graphed attention (kernels/triton_graph_attention.py) with split-KV: ADAPTIVE splits by tile and by token,
    # both merges, on bf16 pages
    from kernels.triton_attention import KernelConfig
    from kernels.triton_graph_attention import GroupTables, graphed_attention
    from tests.kernels.test_graph_attention import _step
    g = Case([1, 6, 1], [40, 20, 3], hq=16, hkv=2, dtype=torch.bfloat16, seed=4)
    tables = GroupTables((16,), 4, g.page_table.shape[1], 0, torch.device("cpu"),
                         (KernelConfig(16, 16, 8), KernelConfig(64, 16, 8)), splits=(3, 2), head_groups=(2, 2),
                         target_programs=64, min_split_keys=8)
    tables.fill(_step(g, True), 16)
    pad = lambda x: torch.cat([x, torch.zeros(16 - x.shape[0], *x.shape[1:], dtype=x.dtype)])  # noqa: E731
    graphed_attention(pad(g.q), pad(g.k), pad(g.v), (g.k_cache, g.v_cache), tables, 16, g.sinks, 0.25, None)


def test_gpu_branches_of_every_kernel_lower_for_sm90(tmp_path):
    with recording(run_kernels=True) as seen:
        _launch_every_kernel()
        _launch_attention()
    kernels = {(r["module"], r["kernel"]) for r in seen.values()}
    assert len(kernels) >= 30, sorted(kernels)  # all but allreduce's (multi-GPU symmetric memory only)
    assert any(r["kernel"] == "_attn_fwd" and r["const"].get("ADAPTIVE") and r["const"].get("SPLIT")
               and r["const"].get("PART_BY_TILE") for r in seen.values())  # the graphed split-KV's GPU branch
    assert any(k == "_merge_tile_splits" for _, k in kernels)
    fp8_kv = [(r["kernel"], r["sig"].get("KC") or r["sig"].get("XC")) for r in seen.values()
              if r["const"].get("KV_WIDEN") or r["const"].get("QUANT") or r["kernel"] == "_gather_kv_kernel"]
    fp8_kv += [(r["kernel"], r["sig"]["KC"]) for r in seen.values() if r["const"].get("FP8_PAGES")]
    # FP8 KV: widened e4m3 pages with and without splits, quantising stores with and without RoPE, the
    # gather, the decode kernel with and without splits
    assert sorted(k for k, _ in fp8_kv).count("_attn_fwd") >= 2 and len(fp8_kv) >= 7, fp8_kv
    assert sorted(k for k, _ in fp8_kv).count("_decode_fwd") >= 2, fp8_kv
    assert all(ty == "*fp8e4nv" for _, ty in fp8_kv), fp8_kv
    recs = list(seen.values())
    built = build_sm90(recs, tmp_path)
    names = [f"{r['module']}.{r['kernel']} {r['const']} {r['opts']}" for r in recs]
    failures = [f"{n}: {b['error']}" for n, b in zip(names, built) if b["error"]]
    assert not failures, "\n\n".join(failures)
    too_big = [(n, b["shared"]) for n, b in zip(names, built) if b["shared"] > SMEM_LIMIT]
    assert not too_big, f"shared memory past the SM90 limit (fails only at launch on the GPU): {too_big}"
