"""GPU runs W and X diagnostic (one H200): the few-token MoE path's leading configurations from run V
re-timed (9 trials, two weight seeds), and a kernel-level breakdown of one CUDA-graph replay under
torch.profiler (route+quantise, gate_up, down, and the time between them)."""
from __future__ import annotations

import collections

import torch

from benchmarks.gemm import bench
from benchmarks.moe import H, MODELS, TOP_K, logit_sets, make_experts, weight_bytes_read
from kernels.moe_small import SmallBatchMoE, SmallConfig

COPY_TBPS = 4.08  # GPU.md ceiling; the MoE bench measures its own
CONFIGS = {  # run Z: TMA weight tiles beside the defaults of run Y
    "new_default": None,  # DEFAULT_SMALL_CONFIGS
    "tma_s2_4": SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=4, pdl=True),
    "tma_s2_4_st2": SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=4, pdl=True, num_stages=2),
    "tma_s2_4_st4": SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=4, pdl=True, num_stages=4),
    "tma_s4_4_st2": SmallConfig(swap_ab=True, tma=True, split_k1=4, split_k2=4, pdl=True, num_stages=2),
    "tma_s2_2": SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=2, pdl=True),
    "tma_s1_4": SmallConfig(swap_ab=True, tma=True, split_k1=1, split_k2=4, pdl=True),
    "tma_auto": SmallConfig(swap_ab=True, tma=True, pdl=True),
}


def profile(impl, x, lsets, w) -> None:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for lg in lsets:
            impl(x, lg, TOP_K, w)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for lg in lsets:
                impl(x, lg, TOP_K, w)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    dur = collections.defaultdict(list)
    gaps = []
    for a, b in zip(events, events[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap < 50:  # within one replay
            gaps.append(gap)
    for e in events:
        dur[e.name[:40]].append(e.time_range.elapsed_us())
    for name, d in dur.items():
        print(f"  kernel {name:40s} n={len(d):4d} mean {sum(d) / len(d):6.2f} us")
    if gaps:
        print(f"  gap (end -> next start, negative = overlap): mean {sum(gaps) / len(gaps):.2f} us, "
              f"min {min(gaps):.2f} max {max(gaps):.2f}")


def main() -> None:
    e = MODELS["20b"]
    for seed in (7, 11):
        w, _ = make_experts(e, seed=seed)
        for t in (1, 2):
            gen = torch.Generator(device="cuda").manual_seed(seed + t)
            x = torch.randn(t, H, device="cuda", generator=gen).to(torch.bfloat16)
            lsets = logit_sets(t, e, gen)
            nbytes = weight_bytes_read(w, lsets)
            for name, cfg in CONFIGS.items():
                impl = SmallBatchMoE(cfg)
                ms = bench([lambda lg=lg: impl(x, lg, TOP_K, w) for lg in lsets], trials=9)
                print(f"seed {seed} T={t} {name:16s} {ms * 1e3:6.1f} us {100 * nbytes / ms / 1e9 / COPY_TBPS:5.1f}% of 4.08 TB/s")
                if seed == 7 and name in ("new_default", "tma_s2_4"):
                    profile(impl, x, lsets, w)
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
