"""The cases and measuring tools of benchmarks/attention.py (its flags, read from sys.argv here too:
--smoke runs tiny shapes on the CPU interpreter, --kv-fp8 makes the pages e4m3 under per-head
scales): gpt-oss attention dims, `make_case` (a StepMeta over scattered pages), `parity` against the
fp32 reference, `bench_ms`, and the JSON recorder. `init_inputs` sets the sinks and K/V scales every
case runs with (main() calls it first).
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
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from kernels import reference as ref  # noqa: E402
from kernels.interface import GroupMeta, StepMeta  # noqa: E402

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


SINKS: torch.Tensor  # [Hq] fp32 raw logits, set by init_inputs
KV_SCALE: tuple[torch.Tensor, torch.Tensor] | None = None  # e4m3 pages: (k_scale, v_scale) [Hkv]


def init_inputs() -> None:
    global SINKS, KV_SCALE
    torch.manual_seed(0)
    SINKS = (torch.randn(HQ, device=DEV) * 2).float()
    SINKS[0], SINKS[-1] = 8.0, -8.0
    if KV_FP8:  # per KV head, not powers of two (a kernel ignoring them fails parity)
        KV_SCALE = (torch.linspace(0.09, 0.16, HKV, device=DEV), torch.linspace(0.1, 0.15, HKV, device=DEV))
