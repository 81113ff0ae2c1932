"""A per-step timeline for diagnosing served latency (`--step-trace PATH`, `%p` = the process id):
one JSON line per engine step, written in batches, so a TTFT breakdown's "local_prefill" can be
split into the steps it waited behind, their sizes and where each step's time went on the host.

    {"step": 812, "t": 31.204, "seqs": 57, "tokens": 264, "chunks": 1, "max_chunk": 208,
     "sched_ms": 0.21, "launch_ms": 4.8, "wait_ms": 9.7, "collected": 811, "launch_cpu_ms": 4.6,
     "collected_gpu_ms": 11.2}

t: seconds since the trace opened, at the step's start; sched_ms: the scheduler; launch_ms: the
runner's launch (host work: inputs, planning, the forward's launches or a graph replay); wait_ms:
blocked collecting the previous step (the GPU was still running it); chunks: prefill chunks in the
step (rows with more than one token, or a first token); collected: the step whose tokens this
iteration collected. launch_cpu_ms: the loop thread's CPU time during the launch (well under
launch_ms: the thread waited: the GIL, a preempted core); collected_gpu_ms: the collected step's span
on the GPU (CUDA runs with a trace only; see engine.runner.time_gpu); collected_first: that step was
done when the iteration began, so it was collected before this launch (sched_ms includes it;
engine.core). Parts, where measured: collect_first_ms (that early collect, inside sched_ms), hold_ms (the
launch held for arrivals before the iteration, --launch-hold: not in sched_ms), and inside
launch_ms meta_ms (step metadata, attention plans, piecewise tables), forward_ms (the forward's launches
or a graph replay) and sample_ms (queueing the sampler). Without a path the rows stay in memory
(`rows`): the start-up warm-up and benchmarks/mixed_step.py read them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


class StepTrace:
    FLUSH_EVERY = 256

    def __init__(self, path: str | None = None) -> None:
        self.rows: list[dict] = []  # kept when there is no file
        self._f = None
        if path is not None:
            self.path = Path(path.replace("%p", str(os.getpid())))
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = self.path.open("a", buffering=1 << 16)
        self._t0 = time.monotonic()
        self._n = 0

    def record(self, step: int, t_start: float, items, sched_s: float, launch_s: float, wait_s: float,
               collected: int | None, launch_cpu_s: float = 0.0, collected_gpu_ms: float | None = None,
               collected_first: bool = False, parts: dict[str, float] | None = None) -> None:
        chunks = [it.q_len for it in items if it.chunk]
        row = {"step": step, "t": round(t_start - self._t0, 6), "seqs": len(items),
               "tokens": sum(it.q_len for it in items), "chunks": len(chunks), "max_chunk": max(chunks, default=0),
               "sched_ms": round(sched_s * 1e3, 3), "launch_ms": round(launch_s * 1e3, 3),
               "wait_ms": round(wait_s * 1e3, 3), "collected": collected,
               "launch_cpu_ms": round(launch_cpu_s * 1e3, 3),
               "collected_gpu_ms": None if collected_gpu_ms is None else round(collected_gpu_ms, 3),
               "collected_first": collected_first}
        for k, v in (parts or {}).items():
            row[f"{k}_ms"] = round(v, 3)
        if self._f is None:
            self.rows.append(row)
            return
        self._f.write(json.dumps(row) + "\n")
        self._n += 1
        if self._n % self.FLUSH_EVERY == 0:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
