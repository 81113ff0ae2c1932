"""The prefill worker's engine on an idle device: N new tokens after a cached prefix of P tokens
against the same lengths uncached, each request's compute time split as the worker reports it
(wire.protocol.ComputeSplit: host before launch, launch, per-layer hooks, wait; GPU span on CUDA).

    python -m benchmarks.prefill_prefix --device cuda --random-weights gpt-oss-20b --fp8 --reps 10
    python -m benchmarks.prefill_prefix --checkpoint DIR          # CPU: a tiny checkpoint (tests/conftest.py)

Takes the prefill worker's own flags (engine/worker_args.py), so the engine is built as the worker
builds it, without the network, the self-test or a decode worker: the KV sender does nothing but,
on CUDA, bound the host's run-ahead to K layers as kv_transfer/nixl_sender.py does (--layers-ahead:
one table per K, -1 = unbounded). Per repetition, one fresh random prompt of P + N tokens:
  uncached P     its first P tokens (this fills the cache: the full pages and the ring's tail)
  cached P+N     the whole prompt: a hit of P tokens, N computed
  uncached N     a fresh prompt of N tokens
  uncached P+N   a fresh prompt of P + N tokens
and the whole prompt again with the cache cleared, whose first token must equal the cached run's
(exact in fp32 on the CPU; bf16 may differ by rounding). The first repetition is a warm-up.
--profile: one more cached P+N under torch.profiler: kernels launched, their summed device time
(against the GPU span: the rest is the GPU waiting for the host) and the table, in $OUT.
--host-profile: one cached P+N and one uncached N under cProfile (which Python the launch time is).
--piecewise-graphs (a worker flag, on by default on a GPU since 2026-12-07): the forward replays CUDA graphs
between its attention calls (engine/piecewise.py); the JSON's "piecewise_graphs" and the table's title say which, and
"build_s" includes their capture. Suite piecewise-ab runs it both ways.
Served numbers (a GPU shared with a decode worker) come from the router's TTFT breakdown header:
`prefill_compute.<part>` (benchmarks/multi_turn.py lists them per turn group).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import environment, out_dir
from engine.build import build_engine_parts, load_model
from engine.worker_args import add_worker_args, engine_config
from kv_transfer.interface import KVSender, TransferOutcome, TransferStatus
from kv_transfer.messages import TransferRequest, encode
from prefill_worker.engine import PrefillEngine
from wire.protocol import PrefillRequest, PrefillResult, SamplingSpec

CASES = ("uncached P", "cached P+N", "uncached N", "uncached P+N")


class NoTransfer(KVSender):
    """Every transfer is DONE at once; on CUDA, layer_done waits for the layer `layers_ahead` back."""

    def __init__(self, layers_ahead: int) -> None:
        self.layers_ahead = layers_ahead
        self._events: list[torch.cuda.Event] = []

    def start(self, request: TransferRequest, pages) -> None:
        self._events = []

    def layer_done(self, layer: int) -> None:
        if self.layers_ahead < 0 or not torch.cuda.is_available():
            return
        ev = torch.cuda.Event()
        ev.record()
        self._events.append(ev)
        if len(self._events) > self.layers_ahead:
            self._events.pop(0).synchronize()

    def progress(self) -> None:
        pass

    def poll(self, request_id: str) -> TransferStatus:
        return TransferStatus.DONE

    def outcome(self, request_id: str) -> TransferOutcome:
        return TransferOutcome(request_id, TransferStatus.DONE, None, "", 0, 0.0)

    def abort(self, request_id: str, reason=None, detail: str = "") -> None:
        pass

    def finish(self, request_id: str) -> TransferOutcome:
        return self.outcome(request_id)

    def close(self) -> None:
        pass


def request(rid: str, prompt: list[int], page_size: int) -> PrefillRequest:
    pages = tuple(range(-(-len(prompt) // page_size)))  # never read: the sender does not write
    target = TransferRequest(rid, "bench", ("tcp://127.0.0.1:1",), (1,), pages, pages[:8], len(prompt),
                             time.time() + 600)
    return PrefillRequest(rid, prompt, SamplingSpec(max_tokens=1, temperature=0.0), encode(target), 600.0)


def row(r: PrefillResult) -> dict:
    assert r.ok and r.split is not None, r.error
    s = r.split
    return {"compute_ms": 1e3 * r.prefill_seconds, "admit_ms": 1e3 * s.admit_seconds,
            "launch_ms": 1e3 * (s.launch_seconds - s.hook_seconds), "hooks_ms": 1e3 * s.hook_seconds,
            "wait_ms": 1e3 * (r.prefill_seconds - s.admit_seconds - s.launch_seconds), "gpu_ms": 1e3 * s.gpu_seconds,
            "cached": r.cached_tokens}


def median(rows: list[dict]) -> dict:
    return {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}


# Host-side CUDA calls that wait for the device (counted in a profile: in the overlapped loop each one
# stalls the host until the GPU has caught up).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaMemcpyAsync", "cudaHostAlloc", "cudaFreeHost", "cudaMalloc", "cudaFree")


def profile(run, path: Path) -> dict:
    """One call of run() under torch.profiler: kernels, their summed device time, the table."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=acts) as prof:
        r = run()
    avgs = prof.key_averages()
    kernels = [k for k in avgs if k.device_type == torch.autograd.DeviceType.CUDA]  # as benchmarks/profile_decode.py
    path.write_text(avgs.table(sort_by="self_cuda_time_total" if kernels else "self_cpu_time_total", row_limit=40)
                    + "\n\nby host time\n" + avgs.table(sort_by="self_cpu_time_total", row_limit=40))
    syncs = {k.key: k.count for k in avgs if k.key in SYNC_CALLS}
    return {"kernels": sum(k.count for k in kernels), "kernel_ms": sum(k.self_device_time_total for k in kernels) / 1e3,
            "host_syncs": syncs, **(row(r) if isinstance(r, PrefillResult) else {})}


def host_profile(run, path: Path, calls: int = 1, between=None, top: int = 45) -> None:
    """`calls` calls of run() under cProfile (`between()` runs unprofiled after each): where the host's launch
    time goes, per function, in microseconds per call of run() (cProfile's own overhead included, so read the
    shares, not the sum), sorted by own time and by cumulative time."""
    import cProfile

    prof = cProfile.Profile()
    wall = 0.0
    for _ in range(calls):
        t0 = time.perf_counter()
        prof.runcall(run)
        wall += time.perf_counter() - t0
        if between is not None:
            between()
    prof.create_stats()
    rows = [(tt, ct, nc, f"{fn[0].split('/work/main/')[-1]}:{fn[1]}({fn[2]})")
            for fn, (_, nc, tt, ct, _) in prof.stats.items()]
    lines = [f"{calls} call(s) of {wall / calls * 1e6:.0f} us each under cProfile (its overhead included)"]
    for key, name in ((0, "own time"), (1, "cumulative")):
        lines += ["", f"==== by {name}: us per call | calls per call | function"]
        for tt, ct, nc, fn in sorted(rows, key=lambda r: -r[key])[:top]:
            lines.append(f"{(tt if key == 0 else ct) / calls * 1e6:9.1f}  {nc / calls:7.1f}  {fn}")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_worker_args(ap, port=0, metrics_port=0)
    ap.add_argument("--prefix", type=int, default=3296, help="P: cached tokens (a multiple of the page size)")
    ap.add_argument("--new", type=int, default=352, help="N: tokens computed after the prefix")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers-ahead", default="2", help="the KV sender's bound on host run-ahead, comma-separated "
                                                         "settings (-1: none)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--host-profile", action="store_true", help="cProfile one cached P+N and one uncached N")
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/prefill_prefix.json)")
    a = ap.parse_args()
    cfg = engine_config(a, role="prefill")
    if cfg.device == "cpu":
        torch.set_num_threads(a.cpu_threads)
    model = load_model(cfg)
    t0 = time.monotonic()
    parts = build_engine_parts(cfg, model)  # KV pool (+ the piecewise graphs' capture)
    build_s = time.monotonic() - t0
    pw = parts.runner.piecewise
    mode = f"piecewise graphs (buckets {list(pw.buckets)})" if pw is not None else "eager forward"
    p = parts.spec.page_size
    if a.prefix % p or a.prefix <= 0:
        raise SystemExit(f"--prefix must be a positive multiple of the page size {p}")
    tx = NoTransfer(2)
    eng = PrefillEngine(parts, tx)
    g = torch.Generator().manual_seed(a.seed)
    vocab = parts.model.cfg.vocab_size
    path = Path(a.out) if a.out else out_dir() / "prefill_prefix.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    res: dict = {"env": environment(), "args": vars(a), "piecewise_graphs": pw is not None,
                 "buckets": list(pw.buckets) if pw is not None else [], "build_s": build_s,
                 "piecewise_mib": {"static": pw.static_bytes() / 2**20, "pool": pw.pool_bytes() / 2**20}
                 if pw is not None else None, "settings": {}}
    for ahead in (int(x) for x in a.layers_ahead.split(",")):
        tx.layers_ahead = ahead
        rows: dict[str, list[dict]] = {c: [] for c in CASES}
        agree = 0
        for rep in range(a.reps + 1):
            whole = prompt(a.prefix + a.new)
            got = {"uncached P": eng.run(request(f"{ahead}.{rep}a", whole[:a.prefix], p)),
                   "cached P+N": eng.run(request(f"{ahead}.{rep}b", whole, p)),
                   "uncached N": eng.run(request(f"{ahead}.{rep}c", prompt(a.new), p)),
                   "uncached P+N": eng.run(request(f"{ahead}.{rep}d", prompt(a.prefix + a.new), p))}
            parts.kv.clear_cache()
            again = eng.run(request(f"{ahead}.{rep}e", whole, p))
            if rep:
                agree += again.first_token == got["cached P+N"].first_token
                for c in CASES:
                    rows[c].append(row(got[c]))
        assert all(r["cached"] == a.prefix for r in rows["cached P+N"]), "the prefix was not a cache hit"
        med = {c: median(rows[c]) for c in CASES}
        res["settings"][ahead] = {"first_token_agreement": f"{agree}/{a.reps}", "median": med, "rows": rows}
        path.write_text(json.dumps(res, indent=1, default=str))
        print(f"P={a.prefix} N={a.new}, {mode}, layers ahead {ahead}, median of {a.reps} (ms); first token "
              f"cached == uncached: {agree}/{a.reps}")
        print(f"{'':14}" + "".join(f"{k:>11}" for k in med[CASES[0]]))
        for c in CASES:
            print(f"{c:14}" + "".join(f"{v:11.2f}" for v in med[c].values()))
    if a.profile:
        whole = prompt(a.prefix + a.new)
        eng.run(request("prof-a", whole[:a.prefix], p))
        res["profile"] = profile(lambda: eng.run(request("prof-b", whole, p)), path.with_suffix(".profile.txt"))
        path.write_text(json.dumps(res, indent=1, default=str))
        print("profile of one cached P+N (under the profiler):", res["profile"])
    if a.host_profile:
        whole = prompt(a.prefix + a.new)
        eng.run(request("hprof-a", whole[:a.prefix], p))
        host_profile(lambda: eng.run(request("hprof-b", whole, p)), path.with_suffix(".host_cached.txt"))
        host_profile(lambda: eng.run(request("hprof-c", prompt(a.new), p)), path.with_suffix(".host_uncached_n.txt"))
        print("host profiles:", path.with_suffix(".host_cached.txt"), path.with_suffix(".host_uncached_n.txt"))


if __name__ == "__main__":
    main()
