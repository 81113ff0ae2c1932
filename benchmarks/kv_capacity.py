"""KV capacity of the real presets per KV dtype, from the workers' own start-up code, on a CPU.

No weights are needed: `engine.build.plan_and_log_kv` (what `build_engine_parts` calls at start-up)
plans the pages from the preset's config and the budget and logs each page group's capacity; here it
runs for each (preset, KV dtype, budget) and its log lines are captured verbatim. With `--allocate`
the pool is also built on the CPU (a real KVPool of that many bytes) and its tensors' sizes checked
against the plan.

    python -m benchmarks.kv_capacity --kv-cache-gib 1 40 --allocate-gib 1
"""

from __future__ import annotations

import argparse
import json
import logging

from benchmarks.common import markdown_table, out_dir
from engine.build import plan_and_log_kv
from model.config import preset
from model.kv_cache import KV_DTYPES, KVPool, PageGroup


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["gpt-oss-20b", "gpt-oss-120b"])
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--kv-cache-gib", nargs="+", type=float, default=[1.0, 40.0])
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sliding rings reserved (the worker default)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--allocate-gib", type=float, default=0.0, help="also build pools up to this budget on the CPU")
    a = ap.parse_args()
    log = logging.getLogger("tandem.engine")
    log.setLevel(logging.INFO)
    rows, logs = [], []
    for name in a.presets:
        cfg = preset(name)
        for gib in a.kv_cache_gib:
            for dt in a.kv_cache_dtype:
                cap = _Capture()
                log.addHandler(cap)
                try:
                    spec = plan_and_log_kv(cfg, int(gib * 2**30), KV_DTYPES[dt], page_size=16,
                                           max_num_seqs=a.max_num_seqs, tp_size=a.tp)
                finally:
                    log.removeHandler(cap)
                allocated = None
                if gib <= a.allocate_gib:
                    pool = KVPool(spec, "cpu")
                    allocated = sum(t.numel() * t.element_size() for t in pool.pools)
                    assert allocated == spec.total_bytes(), (allocated, spec.total_bytes())
                    del pool
                full, sliding = spec.num_pages[PageGroup.FULL], spec.num_pages[PageGroup.SLIDING]
                per_token = spec.page_bytes(PageGroup.FULL) // spec.page_size
                rows.append({"model": name, "kv_dtype": dt, "budget_gib": gib, "tp": a.tp,
                             "bytes_per_token_full_layers": per_token,
                             "full_group_tokens": full * spec.page_size, "sliding_rings": sliding // spec.ring_pages,
                             "ring_mib_per_seq": spec.ring_pages * spec.page_bytes(PageGroup.SLIDING) / 2**20,
                             "tokens_per_gib_full_group": 2**30 // per_token,
                             "allocated_bytes": allocated, "log": cap.lines[0]})
                logs.append(f"[{name} --kv-cache-dtype {dt} --kv-cache-gib {gib:g}] " + "\n    ".join(cap.lines))
    print("\n".join(logs))
    table = markdown_table(rows, ["model", "kv_dtype", "budget_gib", "bytes_per_token_full_layers", "full_group_tokens",
                                  "sliding_rings", "ring_mib_per_seq", "tokens_per_gib_full_group"])
    print(table)
    path = out_dir() / "kv_capacity.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(a), "rows": rows, "logs": logs}, indent=1))


if __name__ == "__main__":
    main()
