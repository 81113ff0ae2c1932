"""Host time of the attention backend's per-step plan for decode steps (FlashInferAttention.plan: the overlapped
loop's launch path, before the graph replay), with FlashInfer 0.6.6's paged plan as shipped (Python's max() over
1-D host tensors, element by element) against the module's max shadowed by kernels.flashinfer_host.tensor_max
(what import_flashinfer installs unless TANDEM_FI_TENSOR_MAX=0). One process, rounds interleaved; B sequences at C
context, both page groups (full, sliding), planned into the decode CUDA graphs' buffers as a decode worker does.

    python -m benchmarks.plan_host [--batches 16,64,128] [--context 3500]
"""

from __future__ import annotations

import argparse
import builtins
import json
import statistics
import time

import torch

from benchmarks.attention_cases import DEV, DT, HKV, HQ, KV_DT, P, W, D, make_case
from benchmarks.common import environment, out_dir
from kernels.flashinfer_host import AttentionDims, tensor_max
from kernels.interface import StepMeta


def decode_step(b: int, context: int) -> StepMeta:
    """A pure-decode step of b sequences, both page groups (the sliding group's pages hold the last W keys)."""
    full = make_case([1] * b, [context - 1] * b, None, seed=1).step
    sliding = make_case([1] * b, [W - 1] * b, W, seed=2).step
    return StepMeta(full.positions, full.cu_seqlens_q, full.q_lens_host, full.logits_indices,
                    (full.groups[0], sliding.groups[1]))


def time_plans(impl, step: StepMeta, n: int) -> float:
    """us per plan() of the same step (the backend re-plans a step it has not seen: _step reset each time)."""
    t0 = time.perf_counter()
    for _ in range(n):
        impl._step = None
        impl.plan(step)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def restore_max(module, shipped) -> None:
    """The module's max as import_flashinfer left it (tensor_max unless TANDEM_FI_TENSOR_MAX=0, else Python's)."""
    if shipped is None:
        vars(module).pop("max", None)
    else:
        module.max = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,64,128")  # one sequence goes to the Triton decode kernel's plan
    ap.add_argument("--context", type=int, default=3500)
    ap.add_argument("--plans", type=int, default=100, help="plans per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (benchmarks.attention_cases reads it)")
    a = ap.parse_args()
    from kernels.flashinfer_backend import FlashInferAttention

    impl = FlashInferAttention()
    import flashinfer.prefill as fi_prefill  # imported by the backend; each round sets its max

    impl.prepare(AttentionDims(HQ, HKV, D, P, DT, DEV, KV_DT), {0: None, 1: W})
    batches = [int(x) for x in a.batches.split(",")]
    impl.enable_cuda_graphs(batches, -(-a.context // P) + 1)
    shipped = vars(fi_prefill).get("max")  # what import_flashinfer left there (None: Python's own)
    rows = []
    for b in batches:
        step = decode_step(b, a.context)
        got: dict[str, list[float]] = {"builtin max": [], "tensor_max": []}
        for _ in range(a.rounds):
            for name, fn in (("builtin max", builtins.max), ("tensor_max", tensor_max)):
                fi_prefill.max = fn
                time_plans(impl, step, 5)  # warm
                got[name].append(time_plans(impl, step, a.plans))
        restore_max(fi_prefill, shipped)
        row = {"batch": b, "context": a.context, **{k: round(statistics.median(v), 1) for k, v in got.items()},
               "rounds": got}
        rows.append(row)
        print(f"plan b={b:4d} ctx={a.context}: builtin max {row['builtin max']:8.1f} us   tensor_max "
              f"{row['tensor_max']:8.1f} us   saved {row['builtin max'] - row['tensor_max']:7.1f} us per step")
    out_dir().mkdir(parents=True, exist_ok=True)
    out = out_dir() / "plan_host.json"
    out.write_text(json.dumps({"env": environment(), "args": vars(a), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
