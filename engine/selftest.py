"""Start-up self-test of an attention backend against the torch reference.

Workers call `self_test_attention(impl, device, dtype)` after choosing a backend and before
reporting ready: a small random case through the real StepMeta builder (scattered pages, both
window kinds, GQA, sinks large and small, a fresh prefill longer than the sliding ring, a chunk on
top of a cached prefix, mixed decode) must match `TorchAttention` run in fp32 on the same inputs,
and the caches it writes must be bit-identical. Anything off raises `AttentionSelfTestFailed`
with the case and the error, so a broken kernel stops the worker instead of serving garbage.
With `rope` the backend also rotates q and k itself (Fusion.ROPE_STORE).
With `kv_dtype` e4m3 the pages are FP8 under random per-head scales and the reference quantises and
dequantises them itself (the ground truth of kernels/reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import ConfigError
from kernels.interface import AttentionImpl, StepMeta
from kernels.reference import apply_rope
from kernels.torch_backend import TorchAttention
from model.context import SeqStep, build_step_meta
from model.kv_cache import KVCacheSpec, KVManager, KVPool, PageGroup, SeqPages

# Relative (Frobenius) error allowed against the fp32 reference, by input dtype.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


class AttentionSelfTestFailed(ConfigError):
    """The chosen attention backend disagrees with the reference on this device."""


@dataclass(frozen=True, slots=True)
class SelfTestShape:
    num_q_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 64
    window: int = 128
    page_size: int = 16

    def schedule(self) -> list[list[tuple[int, int]]]:
        """Steps as [(seq, new tokens)]: a prefill longer than the ring next to a short one; a
        decode, a chunk on a cached prefix and a new sequence; then a decode of all three."""
        w, p = self.window, self.page_size
        return [[(0, 2 * w + p + 5), (1, w // 4 + 3)],
                [(0, 1), (1, w + p + 3), (2, 7)],
                [(0, 1), (1, 1), (2, 1)]]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def self_test_attention(impl: AttentionImpl, device: torch.device | str, dtype: torch.dtype, *,
                        shape: SelfTestShape | None = None, seed: int = 0, kv_dtype: torch.dtype | None = None,
                        rope: bool = False) -> None:
    """rope: q and k go in unrotated with rope=(cos, sin), as the model passes them under
    Fusion.ROPE_STORE where it stores (cached steps); the reference gets them rotated in `dtype`."""
    s = shape or SelfTestShape()
    kv_dtype = kv_dtype or dtype
    fp8 = kv_dtype == torch.float8_e4m3fn
    device = torch.device(device)
    tol = _TOLERANCE[dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shp: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shp, generator=gen) * scale).to(device)

    sched = s.schedule()
    max_len = sum(n for step in sched for seq, n in step if seq == 0) + 2 * s.page_size
    num_pages = 3 * (max_len // s.page_size + 2)
    spec = KVCacheSpec(s.page_size, s.num_kv_heads, s.head_dim, kv_dtype, s.window, full_layers=(1,),
                       sliding_layers=(0,), num_pages=(num_pages, num_pages))
    mgr = KVManager(spec)
    for alloc in mgr.alloc:  # scatter: hand the pages back in a random order
        pages = alloc.allocate(alloc.num_pages)
        alloc.free([pages[i] for i in torch.randperm(len(pages), generator=gen).tolist()])
    pool = KVPool(spec, device)
    # same zeros, never aliased; fp32 unless the pages are FP8 (then the reference writes e4m3 too)
    ref_pools = [p.clone() if fp8 else p.to(torch.float32, copy=True) for p in pool.pools]
    kv_scale = None
    if fp8:  # per-head scales, neither 1 nor powers of two, so a kernel ignoring them fails
        kv_scale = ((torch.rand(s.num_kv_heads, generator=gen) * 0.2 + 0.01).to(device),
                    (torch.rand(s.num_kv_heads, generator=gen) * 0.01 + 0.002).to(device))
    ref_impl = TorchAttention()
    sinks = rand(s.num_q_heads, scale=2.0).float()
    sinks[0], sinks[-1] = 8.0, -8.0  # a sink that dominates and one that vanishes
    sm_scale = s.head_dim ** -0.5
    windows = {PageGroup.FULL: None, PageGroup.SLIDING: s.window}

    seqs: dict[int, SeqPages] = {}
    lens: dict[int, int] = {}
    cases: list[tuple[str, StepMeta, bool]] = []
    for i, step_spec in enumerate(sched):
        steps = []
        for seq, n in step_spec:
            pages = seqs.setdefault(seq, SeqPages())
            start = lens.get(seq, 0)
            mgr.grow(pages, start + n)
            steps.append(SeqStep(pages, start, n))
            lens[seq] = start + n
        cases.append((f"step {i}", build_step_meta(steps, spec, device), True))
    cases.append(("no cache", build_step_meta([SeqStep(None, 0, n) for _, n in sched[0]], None, device), False))

    failures = []
    for name, step, cached in cases:
        t = sum(step.q_lens_host)
        impl.plan(step)
        ref_impl.plan(step)
        for g in PageGroup:
            q = rand(t, s.num_q_heads, s.head_dim).to(dtype)  # [T, Hq, D]
            k = rand(t, s.num_kv_heads, s.head_dim).to(dtype)  # [T, Hkv, D]
            v = rand(t, s.num_kv_heads, s.head_dim).to(dtype)
            kv = (pool.pools[g][0, 0], pool.pools[g][0, 1]) if cached else None
            ref_kv = (ref_pools[g][0, 0], ref_pools[g][0, 1]) if cached else None
            if rope and cached:
                cos, sin = rand(t, s.head_dim // 2).float(), rand(t, s.head_dim // 2).float()
                out = impl.forward(g, q, k, v, kv, sinks, sm_scale, windows[g], kv_scale=kv_scale, rope=(cos, sin))
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # what the reference sees
            else:
                out = impl.forward(g, q, k, v, kv, sinks, sm_scale, windows[g], kv_scale=kv_scale)
            ref = ref_impl.forward(g, q.float(), k.float(), v.float(), ref_kv, sinks, sm_scale, windows[g],
                                   kv_scale=kv_scale)
            what = f"{name}, {g.name.lower()} layer (window {windows[g]})"
            if out.shape != q.shape or out.dtype != dtype:
                failures.append(f"{what}: output {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {dtype}")
                continue
            err = _rel_err(out, ref)
            if not torch.isfinite(out).all() or not err <= tol:
                failures.append(f"{what}: relative error {err:.3g} > {tol:g}")
            same = (torch.equal(pool.pools[g].view(torch.uint8), ref_pools[g].view(torch.uint8)) if fp8
                    else torch.equal(pool.pools[g].float(), ref_pools[g]))
            if cached and not same:
                failures.append(f"{what}: KV cache contents differ from the reference store")
    if failures:
        raise AttentionSelfTestFailed(
            f"attention backend {impl.name!r} failed its self-test on {device} ({dtype}, KV {kv_dtype}): "
            + "; ".join(failures))
