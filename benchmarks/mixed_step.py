"""The decode worker's engine on an idle device, serving what a colocated multi-turn turn looks like:
B sequences decoding at context C while a new turn arrives whose prompt extends a finished one
(P cached tokens, N new): the step that prefills it joins the decode batch (a mixed step).

multi-turn-colocated-pw-2 (2026-12-03) traced such steps in the served decode worker at ~30 ms of host launch
(p50, piecewise graphs on); mixed-step-5 timed their GPU span too (34 ms: FlashInfer's fa3 paged kernel on the
decode rows, now read on fa2). This script reproduces that step alone and says where its time goes:

  decode       steady decode steps: host launch, wait for the step before (the GPU still busy)
  mixed        the step that prefills the new turn: launch (and its CPU time), GPU span, and the
               turn's time to first token here (added -> its token collected), for each --forwards x
               --orders x --mixed-roles
  --timeline   the GPU timeline of a mixed step and the step collecting it (busy, idle gaps)
  --host-profile  cProfile of one mixed step's launch; --profile  torch.profiler (CPU + CUDA) of
               the same: the host-side CUDA calls (syncs, copies) and their time

    python -m benchmarks.mixed_step --device cuda --fp8 --random-weights gpt-oss-20b --cuda-graphs \\
        --piecewise-graphs --max-num-batched-tokens 4096 --max-model-len 16384 --kv-cache-gib 28 --host-profile
    python -m benchmarks.mixed_step --random-weights tiny --batch 4 --context 96 --prefix 64 --new 16  # CPU smoke

Takes the decode worker's flags (engine/worker_args.py); the engine is built as the worker builds it
(CUDA graphs for pure decode steps with --cuda-graphs), without the network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import environment, out_dir
from benchmarks.prefill_prefix import host_profile, profile
from engine.build import build_engine_parts, load_model, make_piecewise
from engine.core import EngineCore
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_trace import StepTrace
from engine.worker_args import add_worker_args, cuda_graphs_on, engine_config


def _launched(rows: list[dict]) -> list[dict]:
    """The step trace's launched steps (engine/step_trace.py), each with its iteration's host time."""
    return [{**r, "step_ms": r["sched_ms"] + r["launch_ms"] + r["wait_ms"]} for r in rows if r["step"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_worker_args(ap, port=0, metrics_port=0)
    ap.add_argument("--batch", type=int, default=60, help="B: sequences decoding")
    ap.add_argument("--context", type=int, default=3500, help="C: their context")
    ap.add_argument("--prefix", type=int, default=3296, help="P: the new turn's cached tokens")
    ap.add_argument("--new", type=int, default=280, help="N: its new tokens")
    ap.add_argument("--turns", type=int, default=8, help="new turns measured per forward mode")
    ap.add_argument("--forwards", default="piecewise,eager",
                    help="mixed-step forwards to compare: piecewise (the worker's flags), piecewise-fine and piecewise-pow2 "
                         "(a second graph set with that spacing, unless it is the worker's), piecewise-sliding and "
                         "piecewise-all (a second set with that attention inside the graphs), eager")
    ap.add_argument("--orders", default="ready,launch",
                    help="loop orders to compare (engine/core.py): ready (a step the GPU already finished is collected "
                         "before the next launch), wait (ready, and a step with first tokens "
                         "is waited for up to 3 ms: --first-token-wait-ms 3) or launch (always launch the next step first)")
    ap.add_argument("--mixed-roles", default="decode",
                    help="FlashInfer: whose kernel reads a mixed step's attention, compared: decode (fa2, GQA-packed) "
                         "and/or prefill (fa3)")
    ap.add_argument("--timeline", action="store_true",
                    help="torch.profiler over a mixed step and the step that collects it: the GPU's busy time, "
                         "its idle gaps and the kernels around the longest (mixed_step.timeline.json)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--host-profile", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="cProfile N mixed steps' iterations (and 4N decode steps'), us per step by function")
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/mixed_step.json)")
    a = ap.parse_args()
    cfg = engine_config(a, role="decode")
    if cfg.device == "cpu":
        torch.set_num_threads(a.cpu_threads)
    model = load_model(cfg)
    parts = build_engine_parts(cfg, model)
    if cuda_graphs_on(a):
        from engine.decode_graphs import CudaGraphDecoder

        parts.runner.graphs = CudaGraphDecoder(model, parts.pool, parts.kv, a.max_num_seqs, a.max_model_len)
        parts.runner.graphs.capture()
    if cfg.device.startswith("cuda"):  # as the worker does before it reports ready (engine/warmup.py)
        from engine.warmup import warm_up

        warm_up(parts, a.seed)
    piecewise = parts.runner.piecewise
    forwards = {"piecewise": piecewise, f"piecewise-{cfg.piecewise_buckets}": piecewise, "eager": None}
    if cfg.piecewise_graphed != "none":
        forwards[f"piecewise-{cfg.piecewise_graphed}"] = piecewise
    for f in a.forwards.split(","):
        if f not in forwards and f.startswith("piecewise-"):  # another bucket spacing or graphed attention, beside
            kind = f[len("piecewise-"):]
            graphed = kind in ("sliding", "all")
            forwards[f] = make_piecewise(cfg, model, parts.pool, buckets=None if graphed else kind,
                                         graphed=kind if graphed else "none")
            forwards[f].capture()
    sched = Scheduler(parts.scheduler.cfg, parts.kv, ())
    core = EngineCore(sched, parts.runner, overlap=a.async_decode == "on")
    core.trace = StepTrace()  # in memory: each step's size and host times
    parts.runner.time_gpu = True  # and its span on the GPU
    g = torch.Generator().manual_seed(a.seed)
    vocab = model.cfg.vocab_size
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    def greedy(prompt_len: int | None = None) -> SamplingParams:  # one token, or as many as the context allows
        n = 1 if prompt_len is None else a.max_model_len - prompt_len - 8
        return SamplingParams(max_tokens=n, temperature=0.0)

    path = Path(a.out) if a.out else out_dir() / "mixed_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def run_until(pred) -> None:
        while not pred():
            core.step()

    # Earlier turns, finished: their prompts are cached (one per measured turn and mode).
    # forward (piecewise graphs or eager) x loop order (engine.core.collect_ready: a finished step is
    # collected before the next launch, or always after it)
    # and the kernel that reads a mixed step's attention (kernels/flashinfer_backend.py mixed_role)
    attn = parts.model.backends.attention
    roles = [r for r in a.mixed_roles.split(",") if r] if hasattr(attn, "mixed_role") else ["-"]
    modes = [f"{f}/{o}/{r}" for f in a.forwards.split(",") if f for o in a.orders.split(",") if o for r in roles]
    turns = {m: [] for m in modes}
    for m in modes:
        for i in range(a.turns + 1):
            s = Sequence(f"prev-{m}-{i}", rand(a.prefix), greedy())
            sched.add(s)
            run_until(lambda s=s: s.finished and core.inflight is None)
            turns[m].append(s.prompt_ids)
    # The decode batch.
    batch = [Sequence(f"dec-{i}", rand(a.context), greedy(a.context)) for i in range(a.batch)]
    for s in batch:
        sched.add(s)
    run_until(lambda: all(s.output_ids for s in batch))
    for _ in range(20):
        core.step()
    core.trace.rows.clear()
    for _ in range(30):
        core.step()
    res: dict = {"env": environment(), "args": vars(a), "decode": _summary(_launched(core.trace.rows))}
    for m in modes:
        forward, order, role = m.split("/")
        if role != "-":
            attn.mixed_role = role
        parts.runner.piecewise = forwards[forward]
        core.collect_ready = order in ("ready", "wait")
        core.first_token_wait_s = 0.003 if order == "wait" else 0.0  # the decode worker's default
        rows = []
        for i, prompt in enumerate(turns[m]):
            s = Sequence(f"turn-{m}-{i}", prompt + rand(a.new), greedy(a.prefix + a.new))
            n0 = len(core.trace.rows)
            t0 = time.perf_counter()
            sched.add(s)
            run_until(lambda s=s: bool(s.output_ids))
            ttft = (time.perf_counter() - t0) * 1e3
            steps = _launched(core.trace.rows[n0:])
            at = next(i for i, r in enumerate(steps) if r["max_chunk"] > 1)
            mixed, after = steps[at], steps[at + 1] if at + 1 < len(steps) else {}
            rows.append({**mixed, "ttft_ms": ttft, "cached": s.num_cached_prefix,
                         "next_launch_ms": after.get("launch_ms"), "next_step_ms": after.get("step_ms"),
                         "gpu_ms": after.get("collected_gpu_ms")})  # the mixed step's span on the GPU
            core.abort(s)  # one turn at a time: the batch stays B
            for _ in range(5):
                core.step()
        med = {k: statistics.median(v) for k in ("launch_ms", "launch_cpu_ms", "step_ms", "gpu_ms", "ttft_ms",
                                                  "tokens", "cached")
               if (v := [r[k] for r in rows[1:] if r.get(k) is not None])}
        res[m] = {"rows": rows[1:], **med}
    parts.runner.piecewise = piecewise if "piecewise" in a.forwards.split(",") else None
    core.collect_ready = True
    core.first_token_wait_s = 0.0
    if roles != ["-"]:
        attn.mixed_role = roles[0]
    if a.host_profile or a.profile or a.timeline:
        prompt = rand(a.prefix)
        pre = Sequence("hprof-prev", prompt, greedy())
        sched.add(pre)
        run_until(lambda: pre.finished)  # the batch keeps decoding: a step stays in flight
        if a.host_profile:
            turn = []

            def add_turn() -> None:  # the next profiled step is a mixed one: a new turn on the cached prompt
                turn.append(Sequence(f"hprof-{len(turn)}", prompt + rand(a.new), greedy(a.prefix + a.new)))
                sched.add(turn[-1])

            def settle() -> None:  # unprofiled: the turn's token, then it leaves (the batch stays B)
                run_until(lambda: bool(turn[-1].output_ids))
                core.abort(turn[-1])
                for _ in range(3):
                    core.step()

            def next_turn() -> None:
                settle()
                add_turn()

            add_turn()
            host_profile(core.step, path.with_suffix(".host_mixed.txt"), a.host_profile, next_turn)  # mixed launches
            settle()  # the turn added after the last profiled call
            host_profile(core.step, path.with_suffix(".host_decode.txt"), 4 * a.host_profile)  # decode steps
        if a.profile:
            sched.add(Sequence("prof", prompt + rand(a.new), greedy(a.prefix + a.new)))
            res["profile"] = profile(core.step, path.with_suffix(".profile.txt"))
            for _ in range(3):
                core.step()
            res["profile_decode"] = profile(core.step, path.with_suffix(".profile_decode.txt"))  # a decode step, beside
        if a.timeline:
            for _ in range(3):
                core.step()
            sched.add(Sequence("timeline", prompt + rand(a.new), greedy(a.prefix + a.new)))
            res["timeline"] = timeline(lambda: (core.step(), core.step()), path.with_suffix(".timeline.json.gz"))
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"B={a.batch} C={a.context}, turn P={a.prefix} N={a.new}; median over {a.turns} turns (ms)")
    d = res["decode"]
    print(f"decode steps: launch {d['launch_ms']:.2f} (cpu {d['launch_cpu_ms']:.2f}), step {d['step_ms']:.2f}, "
          f"GPU span {d.get('collected_gpu_ms') or 0:.2f}")
    for m in modes:
        r = res[m]
        print(f"mixed ({m}): {r['tokens']:.0f} tokens, cached {r['cached']:.0f}: launch {r['launch_ms']:.2f}, "
              f"(cpu {r.get('launch_cpu_ms', 0):.2f}), step {r['step_ms']:.2f}, GPU span {r.get('gpu_ms') or 0:.2f}, "
              f"turn's first token {r['ttft_ms']:.2f}")


def timeline(run, path: Path, top: int = 12) -> dict:
    """run() under torch.profiler, then the device's timeline from the exported trace: its span (first
    kernel start -> last end), the time some kernel or copy ran, and the longest idle gaps with the
    kernels on either side. The trace itself goes to `path` (gzipped chrome trace)."""
    import gzip

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        sync()
    raw = path.with_suffix("")  # .timeline.json
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    path.write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    dev = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur") is not None)
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")]
    if not dev:
        return {}
    busy, gaps = 0.0, []
    start, end, last = dev[0]
    for s0, e0, name in dev[1:]:
        if s0 > end:
            gaps.append({"gap_us": round(s0 - end, 1), "at_us": round(end - dev[0][0], 1), "after": last[:80],
                         "before": name[:80]})
            busy += end - start
            start, end = s0, e0
        elif e0 > end:
            end = e0
        last = name if e0 >= end else last
    busy += end - start
    gaps.sort(key=lambda g: -g["gap_us"])
    out = {"span_ms": round((max(e for _, e, _ in dev) - dev[0][0]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
           "idle_ms": round(sum(g["gap_us"] for g in gaps) / 1e3, 3), "gaps": len(gaps),
           "gaps_over_100us": sum(g["gap_us"] > 100 for g in gaps), "longest": gaps[:top],
           "host_syncs": [{"name": e["name"], "dur_us": e.get("dur")} for e in syncs][:top]}
    print(f"timeline: GPU span {out['span_ms']:.2f} ms, busy {out['busy_ms']:.2f}, idle {out['idle_ms']:.2f} in "
          f"{out['gaps']} gaps ({out['gaps_over_100us']} over 100 us)")
    for g in gaps[:top]:
        print(f"  gap {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:7.2f} ms: after {g['after'][:50]} | before {g['before'][:50]}")
    return out


def _summary(rows: list[dict]) -> dict:
    keys = ("launch_ms", "launch_cpu_ms", "step_ms", "tokens", "collected_gpu_ms")
    return {k: statistics.median(v) for k in keys if (v := [r[k] for r in rows if r.get(k) is not None])}


if __name__ == "__main__":
    main()
