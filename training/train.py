"""Train the embedded demo model: `python -m training.train [--steps 4000] [--seed 0]`.

Run once by the project (not on a user's machine); the result is committed as
model/demo/gpt-oss-tiny-demo.safetensors and expanded into the full HF layout by
model.checkpoint_io.write_demo_checkpoint. Reproducible: seeded data, init and batch order, a
fixed step count, fp32 on one CPU thread. The file's metadata records the run (steps, wall and
CPU minutes, teacher-forced accuracy); training.evaluate measures greedy decoding of the served
checkpoint.

Schedule: AdamW with warm-up and cosine decay. The first `--copy-steps` draw from a copy-heavy
task mix (tasks.COPY_WEIGHTS): copying from the context needs an induction circuit, which this
tiny RoPE model forms only after hundreds of steps of dense copy signal (measured on a synthetic
copy task: ~800 steps at lr 1e-3, none at 3e-3 in 2500 steps), and everything else is easy once it
exists. For the last `--qat` fraction the forward uses the stored number formats (bf16 weights,
MXFP4 experts) through a straight-through estimator, so the greedy answers survive the
conversion. Loss only on the assistant's reply tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

from model.config import preset
from model.demo import DEMO_FILE, DEMO_PRESET, save_compact
from router.harmony import HarmonyFormat
from training.data import Example, held_out, make_examples, space_pairs, vocabulary
from training.tasks import COPY_WEIGHTS
from training.model import DemoModel, export

EVAL_TASKS = ["greet", "about", "math", "echo", "json", "other", "tool", "tool_res"]


def batches(examples: list[Example], remap: torch.Tensor, tokens_per_batch: int, r: random.Random):
    """Endless length-bucketed batches: (ids, targets, weight, pad), each [B, T]."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].prompt) + len(examples[i].reply))
    groups, cur, cur_max = [], [], 0
    for i in order:
        n = len(examples[i].prompt) + len(examples[i].reply) - 1
        if cur and max(cur_max, n) * (len(cur) + 1) > tokens_per_batch:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    groups.append(cur)
    while True:
        r.shuffle(groups)
        for g in groups:
            seqs = [examples[i] for i in g]
            t = max(len(e.prompt) + len(e.reply) - 1 for e in seqs)
            ids = torch.zeros(len(seqs), t, dtype=torch.long)
            tgt = torch.zeros_like(ids)
            w = torch.zeros(len(seqs), t)
            pad = torch.ones(len(seqs), t, dtype=torch.bool)
            for b, e in enumerate(seqs):
                full = remap[torch.tensor(e.prompt + e.reply)]
                n = len(full) - 1
                ids[b, :n], tgt[b, :n], pad[b, :n] = full[:-1], full[1:], False
                w[b, len(e.prompt) - 1:n] = 1.0  # predict every reply token, the first from the prompt's end
            yield ids, tgt, w, pad


@torch.no_grad()
def greedy_accuracy(model: DemoModel, examples: list[Example], remap: torch.Tensor, quantize: bool) -> dict:
    """Teacher-forced check of whole replies: a reply counts when every reply token is the argmax and
    beats the unused tokens' shared logit (exactly what greedy decoding of the served model needs)."""
    by_task: dict[str, list[int]] = {}
    for i in range(0, len(examples), 32):
        chunk = examples[i:i + 32]
        t = max(len(e.prompt) + len(e.reply) - 1 for e in chunk)
        ids = torch.zeros(len(chunk), t, dtype=torch.long)
        pad = torch.ones(len(chunk), t, dtype=torch.bool)
        for b, e in enumerate(chunk):
            full = remap[torch.tensor(e.prompt + e.reply)]
            ids[b, :len(full) - 1], pad[b, :len(full) - 1] = full[:-1], False
        logits, unused = model.logits(model(ids, pad, quantize), quantize)
        for b, e in enumerate(chunk):
            s = slice(len(e.prompt) - 1, len(e.prompt) + len(e.reply) - 1)
            lg = logits[b, s]
            want = remap[torch.tensor(e.reply)]
            ok = bool((lg.argmax(-1) == want).all() and (lg.max(-1).values > unused[b, s]).all())
            by_task.setdefault(e.task, []).append(int(ok))
    return {k: sum(v) / len(v) for k, v in sorted(by_task.items())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.train")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--copy-steps", type=int, default=1500, help="first steps on the copy-heavy mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--examples", type=int, default=60000)
    p.add_argument("--tokens-per-batch", type=int, default=2000)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--qat", type=float, default=0.4, help="final fraction trained on the stored formats")
    p.add_argument("--threads", type=int, default=1, help="one: on a shared CPU a second thread mostly spins")
    p.add_argument("--out", default=str(DEMO_FILE))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    fmt = HarmonyFormat()
    train = make_examples(fmt, a.seed, a.examples)
    copy_train = make_examples(fmt, a.seed + 2, a.examples // 4, weights=COPY_WEIGHTS)
    evals = held_out(fmt, train + copy_train, a.seed + 1, 40, EVAL_TASKS)
    vocab = vocabulary(fmt, train + copy_train + evals)
    remap = torch.full((fmt.tokenizer.vocab_size,), -1, dtype=torch.long)
    remap[torch.tensor(vocab)] = torch.arange(len(vocab))
    cfg = preset(DEMO_PRESET)
    model = DemoModel(cfg, len(vocab), a.seed)
    model.init_pairs(space_pairs(fmt, vocab))
    n_params = sum(x.numel() for x in model.parameters())
    print(f"data: {len(train)} conversations, vocabulary {len(vocab)} tokens, model {n_params / 1e6:.2f} M "
          f"parameters (restricted vocabulary); prepared in {time.time() - t0:.0f} s", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01)
    stream = batches(train, remap, a.tokens_per_batch, random.Random(a.seed))
    copy_stream = batches(copy_train, remap, a.tokens_per_batch, random.Random(a.seed + 2))
    probe = [e for i, e in enumerate(evals) if i % 4 == 0]  # a quarter of the held-out set, for progress
    t_train, c_train, step = time.time(), time.process_time(), 0
    while step < a.steps:
        frac = step / a.steps
        lr = a.lr * min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt, w, pad = next(copy_stream if step < a.copy_steps else stream)
        quantize = frac >= 1.0 - a.qat
        loss = model.loss(model(ids, pad, quantize), tgt, w, quantize)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step} {time.time() - t_train:6.0f}s loss {loss.item():.4f} lr {lr:.2e}"
                  f"{' qat' if quantize else ''}", flush=True)
        if step % 500 == 0:
            model.eval()
            acc = greedy_accuracy(model, probe, remap, quantize)
            model.train()
            print(f"step {step} teacher-forced exact match on {len(probe)} held-out: {json.dumps(acc)}", flush=True)
    train_s, cpu_s = time.time() - t_train, time.process_time() - c_train
    model.eval()
    acc = greedy_accuracy(model, evals, remap, quantize=True)
    print(f"trained {step} steps in {train_s / 60:.1f} min ({cpu_s / 60:.1f} CPU min); held-out teacher-forced exact match "
          f"(stored formats): {json.dumps(acc)}", flush=True)
    meta = {"seed": a.seed, "steps": step, "train_minutes": round(train_s / 60, 2),
            "train_cpu_minutes": round(cpu_s / 60, 2), "examples": a.examples, "copy_steps": a.copy_steps,
            "tokens_per_batch": a.tokens_per_batch, "lr": a.lr, "qat": a.qat, "vocab_size_used": len(vocab),
            "teacher_forced_exact_match": acc}
    out = save_compact(export(model), vocab, Path(a.out), meta)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
