"""Train several demo models at once on one GPU and keep the best: `python -m training.sweep --out DIR`.

What the `demo-train` suite runs on an H200 (benchmarks/suites.py). Lifecycle:
  1. the data, once: training.data.build_dataset in a pool of processes (every CPU core), saved
     to a scratch file that every run loads (only the runs' own files land in DIR);
  2. one `python -m training.train` process per (configuration, seed), all at once on the same GPU,
     each with a wall-clock cap on its training loop (`--minutes`) and evaluated by itself at the
     end (training.evaluate: greedy decoding of held-out conversations per task and of the
     integration tests' conversations, sampling at temperature 1); logs and results in DIR/runs/NAME/;
  3. the best run by its score (2 x greedy structure + sampled structure + greedy exact match + the
     tests' conversations answered exactly; ties: fewer parameters, cheaper to serve) is copied to
     DIR/gpt-oss-tiny-demo.safetensors, its metadata extended with the sweep (command, every
     candidate's score), and DIR/best.json written (the runs' own weight files are deleted: the
     device tool returns at most 16 MiB a file); the table is printed last;
  4. if time is left, the winner is decoded once more by the served engine (engine.llm on the CPU,
     the expanded HF checkpoint) on the tests' conversations: DIR/best.json's "engine_check".

A run that has not finished by `--deadline-s` (from the sweep's start) is stopped and left out.
`--smoke` is the CPU check of the machinery: two tiny runs of 20 steps on a small data set.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> training.train flags. Base shape: the tiny-demo preset (h128, 4 layers, 4 q / 2 KV heads of 32,
# 4 experts top-2). Serving cost on a CPU is dominated by the 201,088-row unembedding, i.e. by the width.
CONFIGS: dict[str, str] = {
    "base": "",
    "lr3e-3": "--lr 3e-3",
    "no-copies": "--repeat-frac 0",
    "no-copies-lr3e-3": "--repeat-frac 0 --lr 3e-3",  # the two best changes of demo-train run 1 together
    "long-copies": "--repeat-frac 0.6 --copy-frac 0.3",
    "heads8": "--heads 8 --kv-heads 2 --head-dim 16",
    "deep6": "--layers 6",
    "w192": "--hidden 192 --heads 6 --kv-heads 2 --head-dim 32",
    "w256": "--hidden 256 --heads 8 --kv-heads 2 --head-dim 32",
}
# Six at once: the runs share the GPU (each step is mostly small kernels), so every extra run costs the others
# steps. Two seeds of the base recipe, its learning rate up, the synthetic copies off and longer, a wider model.
DEFAULT_RUNS = "base:0,base:1,lr3e-3:0,no-copies:0,long-copies:0,w256:0"
SMOKE_RUNS = "base:0,heads8:1"
SMOKE_FLAGS = ("--steps 20 --tokens-per-batch 2000 --repeat-tokens 512 --warmup 10 --sampled-per-task 1 "
               "--max-new 24 --threads 1")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--runs", default=None, help=f"CONFIG:SEED,... (default {DEFAULT_RUNS}; configs: "
                   f"{', '.join(CONFIGS)})")
    p.add_argument("--device", default="cuda")
    p.add_argument("--minutes", type=float, default=4.5, help="each run's training-loop cap")
    p.add_argument("--deadline-s", type=float, default=450, help="runs still going this long after the start "
                   "are stopped and left out")
    p.add_argument("--reserve-s", type=float, default=120, help="seconds left before the deadline for each run's "
                   "start and its evaluation (a batched greedy + sampled decode: ~10 s on an H200)")
    p.add_argument("--examples", type=int, default=240000)
    p.add_argument("--copy-examples", type=int, default=60000)
    p.add_argument("--eval-per-task", type=int, default=40)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes rendering the data")
    p.add_argument("--extra", default="", help="more training.train flags for every run, one string")
    p.add_argument("--engine-check", action=argparse.BooleanOptionalAction, default=True,
                   help="decode the winner once more through engine.llm (CPU) when time is left")
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny data, 20 steps, two runs")
    a = p.parse_args(argv)
    if a.smoke:
        a.runs = a.runs or SMOKE_RUNS
        a.examples, a.copy_examples, a.eval_per_task = min(a.examples, 2000), min(a.copy_examples, 500), 2
        a.minutes, a.extra = 0.0, f"{SMOKE_FLAGS} {a.extra}"
    a.runs = a.runs or DEFAULT_RUNS
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.monotonic()
    runs = []
    for item in a.runs.split(","):
        name, _, seed = item.partition(":")
        if name not in CONFIGS:
            raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
        runs.append((f"{name}-s{seed or 0}", CONFIGS[name], int(seed or 0)))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "runs").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="demo-sweep-"))
    try:
        data = build_data(a, scratch)
        print(f"[sweep] data ready in {time.monotonic() - t0:.0f} s; starting {len(runs)} runs on {a.device}", flush=True)
        results = train_all(a, runs, data, t0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    best = pick(results)
    record = {"command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "runs": results, "best": best,
              "seconds": round(time.monotonic() - t0)}
    if best is not None:
        best = finish(a, best, results, record, t0)
    for r in results:  # the device tool returns 16 MiB a file: only the winner's weights stay (DIR/...safetensors)
        Path(a.out / "runs" / r["name"] / "model.safetensors").unlink(missing_ok=True)
    (a.out / "sweep.json").write_text(json.dumps(record, indent=1) + "\n")
    print(table(results, best), flush=True)
    print(f"[sweep] {round(time.monotonic() - t0)} s in all", flush=True)
    return 0 if best is not None else 1


def build_data(a: argparse.Namespace, scratch: Path) -> Path:
    from router.harmony import HarmonyFormat
    from training.data import build_dataset, save_dataset
    from training.evaluate import probes

    data = build_dataset(a.data_seed, a.examples, a.copy_examples, a.eval_per_task, a.workers,
                         extra_eval=probes(HarmonyFormat(), time.strftime("%Y-%m-%d")))
    return save_dataset(data, scratch / "data.pt")


def train_all(a: argparse.Namespace, runs: list[tuple[str, str, int]], data: Path, t0: float) -> list[dict]:
    minutes = a.minutes
    if minutes > 0:  # leave each run --reserve-s to start and to evaluate before the deadline
        minutes = round(max(0.5, min(minutes, (a.deadline_s - (time.monotonic() - t0) - a.reserve_s) / 60)), 2)
        if minutes < a.minutes:
            print(f"[sweep] {minutes} min of training per run (the data took long)", flush=True)
    procs = []
    for name, flags, seed in runs:
        d = a.out / "runs" / name
        d.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "training.train", "--device", a.device, "--data", str(data), "--seed", str(seed),
                "--minutes", str(minutes), "--out", str(d / "model.safetensors"), "--result", str(d / "result.json"),
                *shlex.split(flags), *shlex.split(a.extra)]
        log = open(d / "train.log", "wb")
        procs.append((name, seed, flags, argv, log, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                                       start_new_session=True)))
    results = []
    for name, seed, flags, argv, log, proc in procs:
        left = a.deadline_s - (time.monotonic() - t0)
        try:
            rc = proc.wait(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            rc = f"stopped at the {a.deadline_s:.0f} s deadline"
        log.close()
        res_file = a.out / "runs" / name / "result.json"
        rec = {"name": name, "seed": seed, "flags": flags, "command": shlex.join(argv[1:]), "rc": rc}
        if rc == 0 and res_file.exists():
            rec.update(json.loads(res_file.read_text()))
        else:
            tail = (a.out / "runs" / name / "train.log").read_text(errors="replace").strip().splitlines()[-3:]
            rec["error"] = " | ".join(tail)
        print(f"[sweep] {name}: {'ok' if 'eval' in rec else 'failed: ' + rec.get('error', '')[-200:]}", flush=True)
        results.append(rec)
    return results


def pick(results: list[dict]) -> dict | None:
    done = [r for r in results if "eval" in r]
    if not done:
        return None
    return max(done, key=lambda r: (r["eval"]["score"], -r["parameters_restricted"]))


def finish(a: argparse.Namespace, best: dict, results: list[dict], record: dict, t0: float) -> dict:
    """The winner into DIR/gpt-oss-tiny-demo.safetensors (its metadata says how it was chosen), best.json."""
    from model.demo import DEMO_FILE, load_compact, save_compact

    src = Path(best["weights"])
    tensors, meta, cfg = load_compact(src)
    vocab = tensors.pop("demo.vocab_ids").tolist()
    meta["sweep"] = {"command": record["command"], "chosen": best["name"],
                     "candidates": {r["name"]: (r["eval"]["score"] if "eval" in r else None) for r in results},
                     "selection": "max of 2 x greedy structure + sampled structure + greedy exact + probes"}
    dst = save_compact(tensors, vocab, a.out / DEMO_FILE.name, meta, cfg)
    best_rec = {k: v for k, v in best.items() if k != "failures"}
    best_rec["file"] = str(dst)
    if a.engine_check and time.monotonic() - t0 < a.deadline_s - 30:  # ~20 s on 16 cores
        best_rec["engine_check"] = engine_check(dst)
        print(f"[sweep] engine check of the winner: {json.dumps(best_rec['engine_check'])[:300]}", flush=True)
    (a.out / "best.json").write_text(json.dumps(best_rec, indent=1, default=str) + "\n")
    record["best"] = best_rec
    return best_rec


def engine_check(weights: Path) -> dict:
    """The tests' conversations through the served engine (CPU): exact and structure per probe."""
    t = time.monotonic()
    try:
        from router.harmony import HarmonyFormat
        from training.evaluate import check, engine_outputs, probes

        fmt = HarmonyFormat()
        ex = probes(fmt, time.strftime("%Y-%m-%d"))
        outs = engine_outputs(weights, ex)
        res = {e.task[len("probe-"):]: dict(zip(("struct", "exact"), check(fmt, e, o))) for e, o in zip(ex, outs)}
        return {"probes": res, "exact": sum(r["exact"] for r in res.values()), "of": len(res),
                "seconds": round(time.monotonic() - t, 1)}
    except Exception as e:  # noqa: BLE001 - recorded; the GPU-side evaluation already chose the winner
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def table(results: list[dict], best: dict | None) -> str:
    head = f"{'run':<20} {'shape':<22} {'steps':>6} {'min':>5} {'struct':>6} {'exact':>6} {'T=1':>6} {'probes':>6} {'score':>6}"
    lines = [head]
    for r in results:
        if "eval" not in r:
            lines.append(f"{r['name']:<20} failed: {str(r.get('rc'))[:40]} {r.get('error', '')[-60:]}")
            continue
        c, ev = r["config"], r["eval"]
        shape = (f"h{c['hidden_size']} L{c['num_hidden_layers']} q{c['num_attention_heads']}/kv"
                 f"{c['num_key_value_heads']} E{c['num_local_experts']}")
        lines.append(f"{r['name']:<20} {shape:<22} {r['steps']:>6} {r['train_minutes']:>5.1f} "
                     f"{ev['greedy']['all']['struct']:>6.3f} {ev['greedy']['all']['exact']:>6.3f} "
                     f"{ev['sampled_struct']['all']:>6.3f} {sum(ev['probes'].values()):>3}/{len(ev['probes']):<2} "
                     f"{ev['score']:>6.3f}")
    if best is not None:
        g = best["eval"]["greedy"]
        lines.append("per task of the best (struct/exact): " + ", ".join(
            f"{t} {v['struct']:.2f}/{v['exact']:.2f}" for t, v in g.items() if t != "all"))
        lines.append(f"best: {best['name']} score {best['eval']['score']:.3f} -> "
                     f"{best.get('file', 'gpt-oss-tiny-demo.safetensors')}")
    else:
        lines.append("best: none (no run finished)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
