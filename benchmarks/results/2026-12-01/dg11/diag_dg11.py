"""GPU run DG11 (one H200): the DeepGEMM MoE's light passes at 8192 tokens (20b).
(1) per-kernel CUDA time of the whole layer (torch profiler), with the many-program expert grouping
    (DG4's profile: the single-program grouping took 109 us of 1.9 ms);
(2) the SwiGLU + re-quantisation pass alone over launch settings (rows per program x warps), on
    the layer's own buffers: us and GB/s of what it must move (h read, act + scales written)."""
from __future__ import annotations

import torch

from benchmarks.gemm import bench
from kernels import moe_dg
from kernels.reference import BLOCK, FP8_MAX
from tests.kernels.test_gemm_moe_gpu import _experts


def main() -> None:
    torch.manual_seed(0)
    w = _experts(32, 2880, 2880, fp8=True)
    t = 8192
    x = torch.randn(t, 2880, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(t, 32, device="cuda").to(torch.bfloat16)
    moe = moe_dg.DeepGemmMoE(min_rows_per_expert=0)
    for _ in range(3):
        moe(x, logits, 4, w)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            moe(x, logits, 4, w)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    print(f"layer: {bench([lambda: moe(x, logits, 4, w)]) * 1e3:.1f} us", flush=True)

    # the SwiGLU pass on a layer-shaped buffer: capacity rows, the tail tiles unused (layout -1)
    from kernels.moe_align import align_by_expert, route_topk_softmax
    _, ids = route_topk_softmax(logits, 4)
    g = align_by_expert(ids, 0, 32, moe_dg.BLOCK_M)
    rows = g.sorted_pairs.shape[0]
    layout = g.block_expert.repeat_interleave(moe_dg.BLOCK_M)
    used = int(g.num_rows.item())
    inter = 2880
    h = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device="cuda")
    kb2 = -(-inter // BLOCK)
    acts = torch.empty(kb2, rows, dtype=torch.float32, device="cuda")
    moved = used * 2 * inter * 2 + rows * inter + rows * kb2 * 4  # h read (used rows), act + scales written
    ref_act = None
    for rows_per, warps in [(32, 8), (16, 4), (32, 4), (64, 8), (64, 4), (128, 8)]:
        def call(rp=rows_per, wp=warps):
            moe_dg._swiglu_quant_kernel[(rows // rp, kb2)](h, w.b1, layout, act, acts, inter, float(w.alpha),
                                                          float(w.limit), h.stride(0), w.b1.stride(0), act.stride(0),
                                                          acts.stride(0), ROWS=rp, GROUP=BLOCK, FP8_MAX_C=FP8_MAX,
                                                          HW_CVT=True, num_warps=wp)
        try:
            call()
            same = ref_act is None or (torch.equal(act.view(torch.uint8), ref_act) and torch.equal(acts, ref_s))
            if ref_act is None:
                ref_act, ref_s = act.view(torch.uint8).clone(), acts.clone()
            ms = bench([call])
            print(f"swiglu rows {rows_per:>3} warps {warps}: {ms * 1e3:6.1f} us {moved / ms / 1e6:6.0f} GB/s "
                  f"same bits as (32, 8): {same}", flush=True)
        except Exception as e:  # noqa: BLE001 - a setting the compiler refuses
            print(f"swiglu rows {rows_per} warps {warps}: {type(e).__name__}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
