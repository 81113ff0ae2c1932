"""Attention inside the piecewise graphs at long context (kernels/triton_graph_attention.py): the graphed kernel with
its per-sequence split-KV (kernels/attention_splits.py, GPU_SPLITS) against the same launches unsplit (what it was
before: one program per tile and KV head streams a sequence's whole context) and against FlashInfer fa2 as the
islands run it (plan outside the timing, eager run). Full-attention layers (where splits apply), bf16 pages,
gpt-oss dims; decode rows alone and mixed steps (a chunk beside decode rows). Each graphed arm is captured in a CUDA
graph on tables filled for the step and timed by replay; parity of both graphed arms against the fp32 reference.

    python -m benchmarks.graph_attention_long [--smoke]
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks import attention_cases as ac
from benchmarks.attention_cases import (DEV, DT, FULL, HKV, HQ, KV_DT, SM_SCALE, SMOKE, D, P, bench_ms, init_inputs,
                                        make_case, parity)
from benchmarks.common import environment, out_dir
from kernels import triton_graph_attention as ga

# (name, q_lens, prefix lens): decode rows are q_len 1
CASES = [
    ("decode 64 x 4k", [1] * 64, [4095] * 64),
    ("decode 1 x 100k + 63 x 1k", [1] * 64, [100_000] + [1023] * 63),
    ("decode 4 x 32k", [1] * 4, [32767] * 4),
    ("decode 1 x 8k", [1], [8191]),
    ("mixed 300 @ 32k + 63 x 2k", [300] + [1] * 63, [32768] + [2047] * 63),
    ("mixed 300 @ 3k + 60 x 3.5k", [300] + [1] * 60, [3000] + [3500] * 60),
] if not SMOKE else [
    ("decode 3 x 40", [1] * 3, [39] * 3),
    ("mixed 9 @ 30 + 2 x 20", [9, 1, 1], [30, 19, 19]),
]
MAX_REL = 2e-2  # bf16 output against fp32 (the eager backends' GPU tests use 1e-2 on a norm ratio)


def graphed_arm(case, splits: dict) -> tuple[float, float, list[int]]:
    """(ms per replay, rel err, the tables' split counts) of graphed_attention on the case's step."""
    from engine.piecewise import FINE_BUCKETS

    t, n = sum(case.q_lens), len(case.q_lens)
    bucket = next((b for b in FINE_BUCKETS if b >= t), t)
    cfgs = ga.graph_configs(HQ // HKV, DEV)
    tables = ga.GroupTables((bucket,), max(64, n), case.step.groups[FULL].page_table.shape[1], FULL, DEV, cfgs,
                            **splits)
    tables.fill(case.step, bucket)
    pad = bucket - t
    q, k, v = (torch.cat([x, torch.zeros(pad, *x.shape[1:], dtype=x.dtype, device=DEV)]) for x in (case.q, case.k,
                                                                                                    case.v))
    def run():  # ac.SINKS: set by init_inputs
        return ga.graphed_attention(q, k, v, (case.kc, case.vc), tables, bucket, ac.SINKS, SM_SCALE, None)

    if DEV.type == "cuda":
        from tests.support.cuda_graph import capture

        graph, out = capture(run)
        graph.replay()
        ms = bench_ms(graph.replay)
    else:
        out = run()
        ms = bench_ms(run)
    rel, _ = parity(case, out[:t])
    return ms, rel, tables.seq_info[5, :n].tolist()


def flashinfer_arm(case) -> float | None:
    if DEV.type != "cuda":
        return None
    from kernels.flashinfer_backend import FlashInferAttention
    from kernels.flashinfer_host import AttentionDims

    impl = FlashInferAttention()
    impl.prepare(AttentionDims(HQ, HKV, D, P, DT, DEV, KV_DT), {FULL: None})
    impl.plan(case.step)
    return bench_ms(lambda: case.run(impl))


def main() -> None:
    init_inputs()
    split = ga.graph_splits(HQ // HKV, HKV, ga.graph_configs(HQ // HKV, DEV), DEV)
    if DEV.type != "cuda":  # the interpreter: tiny pieces so the smoke run splits
        split = {"splits": (4, 2), "head_groups": (2, 2), "target_programs": 64, "min_split_keys": 8}
    rows, bad = [], []
    for name, q_lens, prefix in CASES:
        case = make_case(q_lens, prefix, None, seed=len(rows))
        ms_split, rel_split, counts = graphed_arm(case, split)
        ms_whole, rel_whole, _ = graphed_arm(case, {})
        fi = flashinfer_arm(case)
        row = {"case": name, "q_lens": len(q_lens), "tokens": sum(q_lens), "max_kv": max(case.kv_lens),
               "split_counts": sorted(set(counts)), "graphed_split_ms": round(ms_split, 4),
               "graphed_unsplit_ms": round(ms_whole, 4), "flashinfer_fa2_ms": None if fi is None else round(fi, 4),
               "rel_split": rel_split, "rel_unsplit": rel_whole}
        rows.append(row)
        if not rel_split <= MAX_REL or not rel_whole <= MAX_REL:
            bad.append(name)
        fi_s = "-" if fi is None else f"{fi:8.3f}"
        print(f"long {name:28s} splits {row['split_counts']!s:12s} graphed split {ms_split:8.3f} ms  unsplit "
              f"{ms_whole:8.3f} ms  FlashInfer fa2 {fi_s} ms  rel {rel_split:.1e}/{rel_whole:.1e}", flush=True)
    out_dir().mkdir(parents=True, exist_ok=True)
    out = out_dir() / "graph_attention_long.json"
    out.write_text(json.dumps({"env": environment(), "max_rel": MAX_REL, "rows": rows}, indent=1))
    print(f"wrote {out}")
    if bad:
        print(f"FAILED parity (> {MAX_REL}): {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
