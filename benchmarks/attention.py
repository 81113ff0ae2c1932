"""Attention parity + speed at gpt-oss dims (64 q / 8 kv heads, d 64, bf16, page 16, scattered pages).

One unattended script for the H200 (results table on stdout, JSON in $OUT/attention.json, rewritten
after every section so a crash loses nothing):
  1. ceilings measured in the same run: device copy bandwidth, bf16 matmul FLOP/s;
  2. parity vs an fp32 torch reference (kernels/reference.py on sampled rows) for the Triton
     backend and FlashInfer fa3/fa2: prompts 1..32k (full and window 128), a chunk on a cached
     prefix, batched decode 1..128 at 8k/32k context; relative error <= 1e-2, no NaN;
  3. timing (triton.testing.do_bench median): prefill TFLOP/s (causal/window-aware FLOPs) and decode
     GB/s of K/V read, for Triton, FlashInfer fa3/fa2 and the torch reference (small sizes), as
     ratios to the ceilings; a small Triton launch-config sweep; decode under a CUDA graph.
Backends: triton = the generic kernel for every step (TritonAttention(decode="off")), triton-decode =
the decode kernel of kernels/triton_decode.py for pure-decode steps (decode rows only: its prefill is
triton's), fi-fa3 / fi-fa2 = FlashInfer's own kernels (with e4m3 pages its fa2 decode variant; the
workers' FlashInfer default sends e4m3 decode to the triton-decode kernel instead). The decode
kernel's sweep (BLOCK_N x warps x stages on decode 128 x 8k, split targets on 64 x 8k; with --kv-fp8
also on bf16 pages against the generic kernel) prints the fraction of copy bandwidth per config and
the summary names the best: the default to pick (kernels/triton_decode.py DEFAULT_DECODE).
FlashInfer JIT variants (fa3 + fa2, window + full) build in a background thread while the Triton
sections run. The built .so files are packed into $OUT/flashinfer-cache.tar.xz (split into
<= 15 MiB parts); FLASHINFER_CACHE_TAR=<that file> restores them as AOT modules (no rebuild).

  python -m benchmarks.attention            # on the GPU (see scripts/fetch_gpu_wheels.sh)
  python -m benchmarks.attention --smoke    # tiny shapes on the CPU interpreter (script check)
  python -m benchmarks.attention --kv-fp8   # the same with e4m3 pages (per-head scales): decode GB/s
                                            # counts the halved bytes; JSON in $OUT/attention_fp8kv.json
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
KV_FP8 = "--kv-fp8" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/tandem-flashinfer")

import json  # noqa: E402
import math  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.flashinfer_cache import restore_cache, save_cache  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.interface import GroupMeta, StepMeta  # noqa: E402
from kernels.torch_backend import TorchAttention  # noqa: E402
from kernels.triton_attention import KernelConfig  # noqa: E402
from kernels.triton_attention_backend import TritonAttention  # noqa: E402
from kernels.triton_decode import DEFAULT_DECODE, DecodeConfig  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float32 if SMOKE else torch.bfloat16  # the interpreter's bf16 arithmetic is not exact
KV_DT = torch.float8_e4m3fn if KV_FP8 else DT  # the pages' dtype
HQ, HKV, D, P = (8, 2, 16, 4) if SMOKE else (64, 8, 64, 16)
W = 8 if SMOKE else 128
PREFILL = [1, 40] if SMOKE else [1, 100, 1000, 4096, 8192, 32768]
DECODE_B = [1, 3] if SMOKE else [1, 8, 32, 64, 128]
DECODE_CTX = [40] if SMOKE else [8192, 32768]
# (real, smoke) sizes of the one-off cases
LONG, CHUNK_PREFIX, CHUNK_NEW, MIXED, TORCH_B, CTX8K = ((40, 11, 9, 7, 2, 31) if SMOKE else
                                                        (8192, 5000, 512, 300, 8, 8192))
OUT = os.environ.get("OUT", "out")
SM_SCALE = D ** -0.5
FULL, SLIDING = 0, 1  # PageGroup values


class Recorder:
    def __init__(self) -> None:
        os.makedirs(OUT, exist_ok=True)
        self.data: dict = {"meta": {}, "ceilings": {}, "parity": [], "timing": [], "sweep": [], "errors": []}

    def section(self, name, fn, *args):
        t0 = time.time()
        try:
            fn(*args)
        except Exception as e:  # one broken section must not lose the others
            record_error(name, e)
        print(f"-- {name}: {time.time() - t0:.1f} s", flush=True)
        self.save()

    def save(self) -> None:
        with open(os.path.join(OUT, "attention_fp8kv.json" if KV_FP8 else "attention.json"), "w") as f:
            json.dump(self.data, f, indent=1, default=str)


REC = Recorder()


def record_error(where: str, e: Exception) -> None:
    REC.data["errors"].append({"section": where, "error": repr(e), "trace": traceback.format_exc()[-2000:]})
    print(f"!! {where}: {e!r}", flush=True)


# ---- cases ------------------------------------------------------------------------------------------
@dataclass
class Case:
    q: torch.Tensor  # [T, Hq, D] new tokens
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    kc: torch.Tensor  # [NP, Hkv, P, D]
    vc: torch.Tensor
    step: StepMeta
    group: int
    window: int | None
    prefix: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    hold_all: bool

    def flops(self) -> float:
        """Causal / window-aware: the query at position x sees min(x + 1, W) keys; 2 matmuls."""
        vis = 0
        for lo, n in zip(self.prefix, self.q_lens):
            hi = lo + n
            cut = hi if self.window is None else min(max(self.window - 1, lo), hi)  # below: x + 1 keys
            vis += (lo + 1 + cut) * (cut - lo) // 2 + (hi - cut) * (self.window or 0)
        return 4.0 * D * HQ * vis

    def kv_bytes(self) -> float:
        """K and V bytes read from the pages (e4m3: half of bf16's)."""
        keys = sum(min(n, self.window or n) for n in self.kv_lens)
        return keys * HKV * D * 2 * self.kc.element_size()

    def run(self, impl):
        return impl.forward(self.group, self.q, self.k, self.v, (self.kc, self.vc), SINKS, SM_SCALE, self.window,
                            kv_scale=KV_SCALE)


def make_case(q_lens, prefix, window, hold_all=True, seed=0, kv_dtype=None) -> Case:
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv_lens = [a + b for a, b in zip(q_lens, prefix)]
    pages = [-(-n // P) for n in kv_lens]
    np_ = sum(pages) + 1
    if (kv_dtype or KV_DT) == torch.float8_e4m3fn:  # e4m3 codes spread over the range; KV_SCALE makes them ~ N(0, 1)
        kc = (torch.randn(np_, HKV, P, D, generator=g, device=DEV) * 8).to(KV_DT)
        vc = (torch.randn(np_, HKV, P, D, generator=g, device=DEV) * 8).to(KV_DT)
    else:
        kc = torch.randn(np_, HKV, P, D, generator=g, device=DEV, dtype=DT)
        vc = torch.randn(np_, HKV, P, D, generator=g, device=DEV, dtype=DT)
    perm = torch.randperm(np_, generator=g, device=DEV).to(torch.int32)
    table = torch.zeros(len(q_lens), max(pages), dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[used:used + n]
        used += n
    t = sum(q_lens)
    q = torch.randn(t, HQ, D, generator=g, device=DEV, dtype=DT)
    k = torch.randn(t, HKV, D, generator=g, device=DEV, dtype=DT)
    v = torch.randn(t, HKV, D, generator=g, device=DEV, dtype=DT)
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=DEV), torch.tensor(q_lens, device=DEV))
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0)
    pos = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, q_lens)]).to(DEV)
    slots = (table[seq, pos // P].long() * P + pos % P) if hold_all else torch.full((t,), -1, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    gm = GroupMeta(table, torch.tensor(prefix, **i32), torch.tensor(kv_lens, **i32), slots.long(), hold_all,
                   list(prefix), kv_lens)
    group = FULL if window is None else SLIDING
    groups = (gm, None) if group == FULL else (None, gm)
    step = StepMeta(pos, cu.to(**i32), list(q_lens), (cu[1:] - 1).to(DEV), groups)
    return Case(q, k, v, kc, vc, step, group, window, list(prefix), list(q_lens), kv_lens, hold_all)


def parity(case: Case, out: torch.Tensor, max_seqs=16) -> tuple[float, float]:
    """fp32 reference on sampled rows (all rows of short prompts; head, tail and two random blocks
    of long ones); keys are read back from the caches (the backend stored the new tokens)."""
    num = den = 0.0
    max_abs = 0.0
    cu = [0]
    for n in case.q_lens:
        cu.append(cu[-1] + n)
    for b in range(min(len(case.q_lens), max_seqs)):
        n, kv, pre = case.q_lens[b], case.kv_lens[b], case.prefix[b]
        table = case.step.groups[case.group].page_table[b]
        ks, vs = KV_SCALE if case.kc.dtype == torch.float8_e4m3fn else (None, None)  # e4m3: read back dequantised
        if case.hold_all:
            keys, vals = ref.gather_pages(case.kc, table, kv, ks), ref.gather_pages(case.vc, table, kv, vs)
        else:
            keys = torch.cat([ref.gather_pages(case.kc, table, pre, ks).float(), case.k[cu[b]:cu[b + 1]].float()])
            vals = torch.cat([ref.gather_pages(case.vc, table, pre, vs).float(), case.v[cu[b]:cu[b + 1]].float()])
        blocks = [(0, n)] if n <= 2048 else [(0, 128), (n - 256, n)] + [
            (s, s + 128) for s in torch.randint(128, n - 384, (2,)).tolist()]
        for i0, i1 in blocks:
            end = kv - n + i1  # the block's last query sees keys < end
            start = 0 if case.window is None else max(0, kv - n + i0 - case.window + 1)
            r = ref.varlen_attention(case.q[cu[b] + i0:cu[b] + i1].float(), keys[start:end].float(),
                                     vals[start:end].float(), torch.tensor([0, i1 - i0], dtype=torch.int32),
                                     torch.tensor([0, end - start], dtype=torch.int32), SINKS, SM_SCALE, case.window)
            o = out[cu[b] + i0:cu[b] + i1].float()
            if not torch.isfinite(o).all():
                return float("nan"), float("nan")
            num += (o - r).pow(2).sum().item()
            den += r.pow(2).sum().item()
            max_abs = max(max_abs, (o - r).abs().max().item())
    return math.sqrt(num / max(den, 1e-30)), max_abs


def bench_ms(fn) -> float:
    if DEV.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


# ---- sections ----------------------------------------------------------------------------------------
def ceilings() -> None:
    if DEV.type != "cuda":
        REC.data["ceilings"] = {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0}
        return
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    mm = bench_ms(lambda: a @ b)
    REC.data["ceilings"] = {"copy_GBps": 2 * x.numel() / ms / 1e6, "matmul_TFLOPs": 2 * 8192 ** 3 / mm / 1e9}
    print(f"ceilings: copy {REC.data['ceilings']['copy_GBps']:.0f} GB/s (read+write), "
          f"bf16 matmul {REC.data['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


def impls(decode: bool = False) -> dict:
    """The backends of a case; decode cases add the decode kernel's row."""
    out = {"triton": TritonAttention(decode="off")}
    if decode:
        out["triton-decode"] = TritonAttention(decode="all")
    out.update(FI_IMPLS)
    return out


def parity_and_timing(kind: str, case: Case, backends: dict, time_it: bool) -> None:
    ceil = REC.data["ceilings"]
    for name, impl in backends.items():
        try:
            impl.plan(case.step)
            out = case.run(impl)
            rel, mx = parity(case, out)
            row = {"kind": kind, "backend": name, "q_lens": case.q_lens[:2], "batch": len(case.q_lens),
                   "ctx": max(case.kv_lens), "window": case.window, "hold_all": case.hold_all, "rel_err": rel,
                   "max_abs": mx, "ok": rel <= 1e-2}
            REC.data["parity"].append(row)
            line = (f"{kind:8s} {name:8s} B={len(case.q_lens):3d} ctx={max(case.kv_lens):6d} w={case.window} "
                    f"rel={rel:.2e}")
            if time_it:
                ms = bench_ms(lambda: case.run(impl))
                tf, gbs = case.flops() / ms / 1e9, case.kv_bytes() / ms / 1e6
                REC.data["timing"].append({**row, "ms": ms, "TFLOPs": tf, "GBps": gbs, "frac_matmul":
                                           tf / ceil["matmul_TFLOPs"], "frac_copy": gbs / ceil["copy_GBps"]})
                line += f"  {ms:8.3f} ms  {tf:6.1f} TFLOP/s ({tf / ceil['matmul_TFLOPs']:.0%})  " \
                        f"{gbs:6.0f} GB/s ({gbs / ceil['copy_GBps']:.0%})"
            print(line + ("" if rel <= 1e-2 else "   <-- FAIL"), flush=True)
        except Exception as e:
            record_error(f"{kind}/{name}", e)


def prefill_section() -> None:
    for n in PREFILL:
        for window in (None, W):
            case = make_case([n], [0], window, seed=n)
            parity_and_timing("prefill", case, impls(), time_it=n >= 1000 or SMOKE)
            del case
    # a sliding-layer chunk on a cached prefix (prefix from pages + new tokens dense, then store)
    parity_and_timing("chunk", make_case([37, CHUNK_NEW], [CHUNK_PREFIX, 3], W, hold_all=False, seed=7), impls(), False)
    parity_and_timing("mixed", make_case([1, MIXED, 1], [LONG // 4, 40, 90], None, seed=8), impls(), False)


def decode_section() -> None:
    for ctx in DECODE_CTX:
        for b in DECODE_B:
            case = make_case([1] * b, [ctx - 1] * b, None, seed=b)
            parity_and_timing("decode", case, impls(decode=True), time_it=True)
            if b == DECODE_B[-2]:
                parity_and_timing("decode", make_case([1] * b, [ctx - 1] * b, W, seed=b + 1), impls(decode=True),
                                  time_it=True)
            del case


def torch_reference_section() -> None:
    small = [make_case([LONG // 8], [0], None, seed=1), make_case([1] * TORCH_B, [CTX8K - 1] * TORCH_B, None, seed=2)]
    for case in small:
        parity_and_timing("prefill" if case.q_lens[0] > 1 else "decode", case, {"torch": TorchAttention()}, True)


def sweep_section() -> None:
    """A few Triton launch shapes on the two headline cases, to pick defaults from data."""
    hpp = HQ // HKV
    cases = {"prefill8k": (make_case([LONG], [0], None, seed=3),
                           [KernelConfig(128, 64, hpp, 8, 3), KernelConfig(128, 128, hpp, 8, 3),
                            KernelConfig(64, 64, hpp, 4, 3), KernelConfig(128, 64, 1, 8, 3)]),
             "decode64x8k": (make_case([1] * DECODE_B[-2], [CTX8K - 1] * DECODE_B[-2], None, seed=4),
                             [KernelConfig(16, 64, hpp, 4, 3), KernelConfig(16, 128, hpp, 4, 3),
                              KernelConfig(16, 64, hpp, 4, 4)])}
    for name, (case, cfgs) in cases.items():
        for cfg in cfgs:
            sweep_one(name, case, lambda c=cfg: TritonAttention(config=c, decode="off"), str(cfg))


def sweep_one(name: str, case: Case, make_impl, label: str) -> None:
    ceil = REC.data["ceilings"]
    try:
        impl = make_impl()
        impl.plan(case.step)
        rel, _ = parity(case, case.run(impl), max_seqs=4)
        ms = bench_ms(lambda: case.run(impl))
        row = {"case": name, "config": label, "ms": ms, "rel_err": rel, "TFLOPs": case.flops() / ms / 1e9,
               "GBps": case.kv_bytes() / ms / 1e6, "kv_dtype": str(case.kc.dtype)}
        row["frac_copy"] = row["GBps"] / ceil["copy_GBps"]
        REC.data["sweep"].append(row)
        print(f"sweep {name:16s} {label}  {ms:.3f} ms  {row['TFLOPs']:.0f} TFLOP/s "
              f"({row['TFLOPs'] / ceil['matmul_TFLOPs']:.0%})  {row['GBps']:.0f} GB/s "
              f"({row['frac_copy']:.3f} of copy)  rel={rel:.1e}" + ("" if rel <= 1e-2 else "   <-- FAIL"), flush=True)
    except Exception as e:
        record_error(f"sweep/{name}/{label}", e)


def decode_sweep_section() -> None:
    """The decode kernel's launch configs on decode 128 x 8k (issue 26's case; 1024 programs, no
    split), split targets on 64 x 8k (512 programs: splits fill the SMs), and with --kv-fp8 a few
    configs on bf16 pages against the generic kernel (whether bf16 pages should use it too)."""
    b = DECODE_B[-1]
    big = make_case([1] * b, [CTX8K - 1] * b, None, seed=6)
    grid = [(32, 1, 3), (64, 1, 3), (128, 1, 3), (64, 2, 3), (128, 2, 3), (64, 4, 3), (128, 4, 3),
            (64, 1, 2), (64, 1, 4), (128, 1, 2), (128, 1, 4), (256, 1, 2), (32, 1, 4)]  # (BLOCK_N, warps, stages)
    for bn, w, st in grid:
        cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
        sweep_one(f"decode{b}x8k", big, lambda c=cfg: TritonAttention(decode="all", decode_config=c), str(cfg))
    del big
    mid = make_case([1] * DECODE_B[-2], [CTX8K - 1] * DECODE_B[-2], None, seed=7)
    for pps in (2, 4, 8, 16):
        cfg = DecodeConfig(block_n=DEFAULT_DECODE.block_n, num_warps=DEFAULT_DECODE.num_warps,
                           num_stages=DEFAULT_DECODE.num_stages, programs_per_sm=pps)
        sweep_one(f"decode{DECODE_B[-2]}x8k", mid, lambda c=cfg: TritonAttention(decode="all", decode_config=c),
                  str(cfg))
    del mid
    if KV_FP8:
        bf = make_case([1] * b, [CTX8K - 1] * b, None, seed=8, kv_dtype=DT)
        sweep_one(f"decode{b}x8k-{str(DT).removeprefix('torch.')}", bf, lambda: TritonAttention(decode="off"),
                  "generic kernel (pick_config)")
        for bn, w, st in ((32, 1, 3), (64, 1, 2), (64, 2, 3), (64, 4, 3)):
            cfg = DecodeConfig(block_n=bn, num_warps=w, num_stages=st)
            sweep_one(f"decode{b}x8k-{str(DT).removeprefix('torch.')}", bf,
                      lambda c=cfg: TritonAttention(decode="all", decode_config=c), str(cfg))


def graph_section() -> None:
    """Decode B=64 x 8k as one captured forward (plan outside the graph, replay inside)."""
    if DEV.type != "cuda":
        return
    b, ctx = 64, 8192
    case = make_case([1] * b, [ctx - 1] * b, None, seed=5)
    for name, impl in list(FI_IMPLS.items()) + [("triton", TritonAttention(decode="off")),
                                                ("triton-decode", TritonAttention(decode="all"))]:
        try:
            ms, gbs, rel = _graph_decode(impl, case, b, ctx)
        except Exception as e:
            record_error(f"graph/{name}", e)
            continue
        REC.data["timing"].append({"kind": "decode-graph", "backend": name, "batch": b, "ctx": ctx, "ms": ms,
                                   "GBps": gbs, "frac_copy": gbs / REC.data["ceilings"]["copy_GBps"], "rel_err": rel})
        print(f"graph    {name:8s} B={b} ctx={ctx}  {ms:.3f} ms  {gbs:.0f} GB/s  rel={rel:.1e}", flush=True)


def _graph_decode(impl, case: Case, b: int, ctx: int) -> tuple[float, float, float]:
    impl.enable_cuda_graphs([b], max_pages_per_seq=ctx // P + 1)  # static tables, re-plannable
    impl.plan(case.step)
    case.run(impl)  # eager warm-up (Triton compiles, lazy tables built)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        case.run(impl)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = case.run(impl)
    graph.replay()
    rel, _ = parity(case, out, max_seqs=4)
    ms = bench_ms(graph.replay)
    return ms, case.kv_bytes() / ms / 1e6, rel


# ---- FlashInfer: build in the background, cache the JIT output ----------------------------------------
FI_IMPLS: dict = {}
FI_BUILD: dict = {}


def flashinfer_build() -> None:
    try:
        t0 = time.time()
        from kernels.flashinfer_backend import AttentionDims, FlashInferAttention, import_flashinfer
        from kernels.flashinfer_variants import build_variant
        fi = import_flashinfer()
        FI_BUILD.update({"version": fi.__version__, "restored_modules": restore_cache()})

        def build(backend, sliding, kv_dtype=None):
            t = time.time()
            key = f"{backend}_{'window' if sliding else 'full'}{'_kv_e4m3' if kv_dtype else ''}"
            try:
                build_variant(backend, DT, D, sliding, kv_dtype)
                FI_BUILD[f"{key}_s"] = round(time.time() - t, 1)
            except Exception as e:
                FI_BUILD[f"{key}_error"] = repr(e)[-2000:]

        threads = [threading.Thread(target=build, args=(b, s)) for b in ("fa3", "fa2") for s in (True, False)]
        if KV_FP8:  # our fa2 variant over e4m3 pages (decode); prefill reads them dequantised with fa3/fa2
            threads += [threading.Thread(target=build, args=("fa2", s, KV_DT)) for s in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dims = AttentionDims(HQ, HKV, D, P, DT, DEV, KV_DT)
        for name in ("fa3", "fa2"):
            if any(key.startswith(name) and key.endswith("_error") and "e4m3" not in key for key in FI_BUILD):
                continue  # its build failed once already; retrying would cost another build
            try:
                impl = FlashInferAttention(prefill_backend=name, decode_backend=name, fp8_decode="flashinfer")
                impl.prepare(dims, {FULL: None, SLIDING: W})
                if impl._fp8_fallback is not None:
                    FI_BUILD[f"{name}_kv_e4m3_fallback"] = "FP8-KV variant unavailable: runs on Triton"
                FI_IMPLS[f"fi-{name}"] = impl
            except Exception as e:
                FI_BUILD[f"{name}_error"] = repr(e)[-2000:]
        FI_BUILD["seconds"] = round(time.time() - t0, 1)
    except Exception as e:
        FI_BUILD["error"] = repr(e)
        FI_BUILD["trace"] = traceback.format_exc()[-3000:]


def main() -> None:
    global SINKS
    torch.manual_seed(0)
    SINKS = (torch.randn(HQ, device=DEV) * 2).float()
    SINKS[0], SINKS[-1] = 8.0, -8.0
    global KV_SCALE
    if KV_FP8:  # per KV head, not powers of two (a kernel ignoring them fails parity)
        KV_SCALE = (torch.linspace(0.09, 0.16, HKV, device=DEV), torch.linspace(0.1, 0.15, HKV, device=DEV))
    REC.data["meta"] = {"torch": torch.__version__, "triton": triton.__version__, "smoke": SMOKE,
                        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
                        "dims": {"hq": HQ, "hkv": HKV, "d": D, "page": P, "window": W, "dtype": str(DT),
                                 "kv_dtype": str(KV_DT)}}
    builder = threading.Thread(target=flashinfer_build) if DEV.type == "cuda" else None
    if builder is not None:
        builder.start()
    REC.section("ceilings", ceilings)
    REC.section("sweep", sweep_section)
    REC.section("decode kernel sweep", decode_sweep_section)
    if builder is not None:
        builder.join()
        REC.data["meta"]["flashinfer_build"] = dict(FI_BUILD)
        print(f"flashinfer: {FI_BUILD}", flush=True)
        REC.section("save flashinfer cache", lambda: REC.data["meta"].update(flashinfer_cache=save_cache(OUT)))
    REC.section("prefill", prefill_section)
    REC.section("decode", decode_section)
    REC.section("torch reference", torch_reference_section)
    REC.section("cuda graph", graph_section)
    REC.section("summary", summarize)
    bad = [r for r in REC.data["parity"] if not r["ok"]]
    REC.data["meta"]["parity_failures"] = len(bad)
    REC.save()
    print(f"done: {len(REC.data['parity'])} parity checks, {len(bad)} over 1e-2, {len(REC.data['errors'])} errors")


def summarize() -> None:
    """The two headline numbers per backend against their targets."""
    rows = {}
    for r in REC.data["timing"]:
        if r["kind"] == "prefill" and r["window"] is None and r["q_lens"][0] == LONG:
            rows.setdefault(r["backend"], {})["prefill_full_8k_TFLOPs"] = round(r["TFLOPs"], 1)
        if r["kind"] == "decode" and r["window"] is None and r["batch"] == DECODE_B[-2] and r["ctx"] == DECODE_CTX[0]:
            rows.setdefault(r["backend"], {})["decode_64x8k_frac_copy"] = round(r["frac_copy"], 3)
        if r["kind"] == "decode" and r["window"] is None and r["batch"] == DECODE_B[-1] and r["ctx"] == DECODE_CTX[0]:
            rows.setdefault(r["backend"], {})["decode_128x8k_frac_copy"] = round(r["frac_copy"], 3)
    for r in REC.data["sweep"]:
        if r["case"] in ("prefill8k", "decode64x8k") and "KernelConfig" in r["config"]:  # the generic kernel
            key = "best_sweep_prefill8k_TFLOPs" if r["case"] == "prefill8k" else "best_sweep_decode64x8k_GBps"
            val = r["TFLOPs"] if r["case"] == "prefill8k" else r["GBps"]
            best = rows.setdefault("triton", {})
            best[key] = round(max(best.get(key, 0.0), val), 1)
        elif "DecodeConfig" in r["config"] and r["rel_err"] <= 1e-2:  # the decode kernel, per sweep case
            best = rows.setdefault("triton-decode", {})
            key = f"best_sweep_{r['case']}_frac_copy"
            if r["frac_copy"] > best.get(key, 0.0):
                best[key] = round(r["frac_copy"], 3)
                best[f"best_sweep_{r['case']}_config"] = r["config"]
    targets = {"prefill_full_8k_TFLOPs": 300, "decode_64x8k_frac_copy": 0.70}
    if KV_FP8:  # issue 26: e4m3 pages, bandwidth counted on the halved bytes
        targets = {"prefill_full_8k_TFLOPs": 300, "decode_128x8k_frac_copy": 0.80}
    REC.data["summary"] = {"targets": targets, "kv_dtype": str(KV_DT), "backends": rows}
    print(f"summary (KV {KV_DT}; targets: " + ", ".join(f"{k} >= {v}" for k, v in targets.items()) + ")")
    for name, vals in rows.items():
        print(f"  {name:8s} " + "  ".join(f"{k}={v}" for k, v in vals.items()), flush=True)
    head = {n: v["decode_128x8k_frac_copy"] for n, v in rows.items() if "decode_128x8k_frac_copy" in v}
    best = rows.get("triton-decode", {}).get(f"best_sweep_decode{DECODE_B[-1]}x8k_frac_copy")
    print(f"decode {DECODE_B[-1]}x8k frac of copy ({str(KV_DT).removeprefix('torch.')} pages): "
          + " ".join(f"{n}={v}" for n, v in head.items()) + (f" best-sweep={best}" if best else "")
          + (" (target 0.8)" if KV_FP8 else ""), flush=True)


SINKS: torch.Tensor
KV_SCALE: tuple[torch.Tensor, torch.Tensor] | None = None

if __name__ == "__main__":
    main()
