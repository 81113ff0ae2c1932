"""Exact-match accuracy of the served demo model: `python -m training.evaluate [--per-task 50]`.

Expands the committed weights into the HF layout (model.checkpoint_io.write_demo_checkpoint),
loads that checkpoint in the single-process engine (engine.llm.LLM: bf16 weights, MXFP4 experts,
fp32 compute, exactly what the workers run) and decodes greedily, stopping on <|return|> / <|call|>
as the router does. Prompts are fresh conversations from another seed whose prompt ids are not
among the training prompts (the training set is regenerated from the seed in the weights'
metadata). A reply counts only if every generated id equals the expected reply, stop token included.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from model.checkpoint_io import write_demo_checkpoint
from model.demo import DEMO_FILE, load_compact
from router.harmony import HarmonyFormat
from router.tokenizer import ASSISTANT_STOP_TOKEN_IDS
from training.data import Example, held_out, make_examples
from training.tasks import COPY_WEIGHTS
from training.train import EVAL_TASKS


def exact_match(llm: LLM, examples: list[Example], fmt: HarmonyFormat, show: int = 0) -> dict[str, float]:
    params = SamplingParams(max_tokens=96, temperature=0, stop_token_ids=list(ASSISTANT_STOP_TOKEN_IDS))
    outs = llm.generate([e.prompt for e in examples], params)
    by_task: dict[str, list[int]] = {}
    shown = 0
    for e, o in zip(examples, outs, strict=True):
        ok = o.output_ids == e.reply
        by_task.setdefault(e.task, []).append(int(ok))
        if not ok and shown < show:
            shown += 1
            print(f"[{e.task}] {fmt.encoding.decode(e.prompt[-24:])!r}\n   want {fmt.encoding.decode(e.reply)!r}\n"
                  f"   got  {fmt.encoding.decode(o.output_ids)!r}")
    acc = {k: round(sum(v) / len(v), 4) for k, v in sorted(by_task.items())}
    acc["all"] = round(sum(sum(v) for v in by_task.values()) / len(examples), 4)
    return acc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.evaluate")
    p.add_argument("--weights", default=str(DEMO_FILE))
    p.add_argument("--per-task", type=int, default=50)
    p.add_argument("--seed", type=int, default=1234, help="of the held-out conversations")
    p.add_argument("--date", default=None, help="fix the current date of every prompt (YYYY-MM-DD)")
    p.add_argument("--show", type=int, default=10, help="print this many failures")
    a = p.parse_args(argv)
    _, meta = load_compact(Path(a.weights))
    fmt = HarmonyFormat()
    t0 = time.time()
    train = make_examples(fmt, meta["seed"], meta["examples"])
    train += make_examples(fmt, meta["seed"] + 2, meta["examples"] // 4, weights=COPY_WEIGHTS)
    evals = held_out(fmt, train, a.seed, a.per_task, EVAL_TASKS, a.date)
    with tempfile.TemporaryDirectory() as d:
        ckpt = write_demo_checkpoint(Path(d) / "ckpt", Path(a.weights))
        llm = LLM(EngineConfig(checkpoint=str(ckpt), kv_cache_bytes=256 << 20))
        acc = exact_match(llm, evals, fmt, a.show)
    print(json.dumps({"held_out_prompts": len(evals), "greedy_exact_match": acc,
                      "seconds": round(time.time() - t0)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
