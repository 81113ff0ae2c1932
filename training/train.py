"""Train the embedded demo model: `python -m training.train --device cuda [--minutes 4.5] [--seed 0]`.

The committed model/demo/gpt-oss-tiny-demo.safetensors was trained on one NVIDIA H200 by the
`demo-train` suite (benchmarks/suites.py), which runs `python -m training.sweep`: several
configurations and seeds as concurrent processes of this module on the one GPU, each evaluated by
greedy decoding, the best one kept. Its metadata records the exact command line, the seed and the
number of steps, so the run can be repeated with `--steps N` and that command (seeded data, init
and batch order; a GPU reproduces it up to floating-point nondeterminism). On a CPU the same code
runs too (`--device cpu --steps 20 --examples 2000 ...` is the smoke test), far too slowly for a
real model. The weights are expanded into the full HF layout by
model.checkpoint_io.write_demo_checkpoint; training.evaluate decodes the served checkpoint.

Data: training.data.build_dataset (or a file the sweep built once for all runs, `--data`): the
main task mix, a copy-heavy mix (tasks.COPY_WEIGHTS) and held-out conversations plus the
integration tests' conversations (training.evaluate.probes) for the final evaluation.

Schedule (fractions of the run): AdamW, linear warm-up then cosine decay to 5 % of `--lr`. For the
first `--repeat-frac` each step adds a batch of synthetic copy sequences (random words, then the
same words again, loss on the repeat): copying from the context needs an induction circuit, which a
tiny model forms only after a long stretch of dense copy signal, and the conversations' copy
signal (echo, tool arguments, JSON, answers built from tool results) is sparse. The first
`--copy-frac` draws conversations from the copy-heavy mix. For the last `--qat` fraction the
forward uses the stored number formats (bf16 weights, MXFP4 experts) through a straight-through
estimator, so greedy answers survive the conversion. Loss only on the assistant's reply tokens.

`--minutes M` caps the training loop's wall time: after the first 40 steps (inside the warm-up,
whose learning rates do not depend on the total, and inside the first two phases, which last at
least 40 steps) the run measures its step time and fixes the total number of steps to fit; a hard
stop at M guards the estimate. The metadata's `reproduce` is the same run as one command with that
total (`--steps N`, plus `--stop-at K` if the hard stop ended it): bit-identical on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import GptOssConfig, preset
from model.demo import DEMO_FILE, DEMO_PRESET, save_compact
from training.data import Packed, build_dataset, load_dataset, unpack
from training.model import DemoModel, export

CALIBRATION_STEPS = (10, 40)  # step time measured between these steps, then the total is fixed


@dataclass(slots=True)
class Group:
    """One batch of conversations of similar length, on the device."""

    t: int  # tokens per row (longest conversation - 1)
    starts: torch.Tensor  # [B] offset of each conversation in the flat tokens
    lens: torch.Tensor  # [B] conversation lengths
    sel: torch.Tensor  # [M] flat positions in [B, T] whose next token is a reply token
    tgt: torch.Tensor  # [M] index of that reply token in the flat tokens


class Batches:
    """Endless length-bucketed batches of one Packed mix, every tensor already on the device:
    next() -> (ids [B, T], pad [B, T], sel [M], targets [M]) without host work beyond launches."""

    def __init__(self, data: Packed, remap: torch.Tensor, tokens_per_batch: int, device: torch.device,
                 r: random.Random) -> None:
        tokens = remap[data.tokens.long()]
        if bool((tokens < 0).any()):
            raise ValueError("the data uses token ids outside the vocabulary")
        self.flat = tokens.to(torch.int32).to(device)
        lens = (data.offsets[1:] - data.offsets[:-1]).long()
        starts, plen = data.offsets[:-1].long(), data.prompt_len.long()
        order, n_of = torch.argsort(lens, stable=True).tolist(), lens.tolist()
        self.groups: list[Group] = []
        cur: list[int] = []
        for i in order + [-1]:
            if i < 0 or (cur and (n_of[i] - 1) * (len(cur) + 1) > tokens_per_batch):  # lens ascend
                if cur:
                    self.groups.append(self._group(torch.tensor(cur), starts, lens, plen, device))
                cur = []
            if i >= 0:
                cur.append(i)
        self.r, self.order, self.device = r, [], device
        self.num_tokens = int(lens.sum())

    @staticmethod
    def _group(idx: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, plen: torch.Tensor,
               device: torch.device) -> Group:
        s, n, p = starts[idx], lens[idx], plen[idx]
        t = int(n.max()) - 1
        r = n - p  # reply tokens per row
        within = torch.arange(int(r.sum())) - torch.repeat_interleave(r.cumsum(0) - r, r)
        rows = torch.arange(len(idx))
        sel = torch.repeat_interleave(rows * t + p - 1, r) + within  # predict reply token j at position p-1+j
        tgt = torch.repeat_interleave(s + p, r) + within
        return Group(t, s.to(device), n.to(device), sel.to(device), tgt.to(device))

    def __len__(self) -> int:
        return len(self.groups)

    def fork(self, r: random.Random) -> Batches:
        """The same batches (shared device tensors) in another order."""
        other = object.__new__(Batches)
        other.flat, other.groups, other.device, other.num_tokens = self.flat, self.groups, self.device, self.num_tokens
        other.r, other.order = r, []
        return other

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.order:
            self.order = list(range(len(self.groups)))
            self.r.shuffle(self.order)
        g = self.groups[self.order.pop()]
        ar = torch.arange(g.t, device=self.device)
        pad = ar[None, :] >= (g.lens - 1)[:, None]  # [B, T]
        idx = torch.where(pad, 0, g.starts[:, None] + ar[None, :])
        return self.flat[idx].long(), pad, g.sel, self.flat[g.tgt].long()


class RepeatBatches:
    """Synthetic copy sequences: L random content words, then the same L words; the loss is on the
    repeat (positions L .. 2L-2 predict words 2 .. L of the copy). Drawn on the device, seeded."""

    def __init__(self, content: torch.Tensor, tokens_per_batch: int, device: torch.device, seed: int) -> None:
        self.content = content.to(device)
        self.tokens, self.device = tokens_per_batch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.r = random.Random(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.r.choice((8, 16, 24, 32, 48))
        b = max(1, self.tokens // (2 * n))
        x = self.content[torch.randint(0, self.content.numel(), (b, n), device=self.device, generator=self.gen)]
        ids = torch.cat([x, x], 1)  # [B, 2L]
        pad = torch.zeros_like(ids, dtype=torch.bool)
        sel = (torch.arange(b, device=self.device)[:, None] * 2 * n + torch.arange(n, 2 * n - 1, device=self.device)).reshape(-1)
        return ids, pad, sel, x[:, 1:].reshape(-1)


def arch(a: argparse.Namespace) -> GptOssConfig:
    """The preset with the command line's shape overrides."""
    base = preset(a.preset)
    over = {k: v for k, v in (("hidden_size", a.hidden), ("intermediate_size", a.intermediate or a.hidden),
                              ("num_hidden_layers", a.layers), ("num_attention_heads", a.heads),
                              ("num_key_value_heads", a.kv_heads), ("head_dim", a.head_dim),
                              ("num_local_experts", a.experts), ("num_experts_per_tok", a.topk)) if v}
    return dataclasses.replace(base, layer_types=(), **over) if over else base


def plan_steps(a: argparse.Namespace, step: int, elapsed: float, per_step: float, per_rep: float) -> int:
    """The total that fits --minutes: steps with copy batches cost per_step, the others per_step - per_rep,
    those of the QAT phase ~30 % more (bf16 rounding, MXFP4 round trips); 15 % kept as a margin."""
    plain = per_step - per_rep
    cost = a.repeat_frac * per_step + (1 - a.repeat_frac) * plain + a.qat * 0.3 * plain
    total = max(60, min(a.steps, int(step + 0.85 * (a.minutes * 60 - elapsed) / cost)))
    print(f"step time {per_step * 1000:.1f} ms ({per_rep * 1000:.1f} ms of it the copy batch): {total} steps fit "
          f"{a.minutes} min", flush=True)
    return total


def phases(a: argparse.Namespace, total: int) -> tuple[int, int, int]:
    """(end of the copy-heavy mix, end of the synthetic copies, start of QAT) in steps. The first two last
    at least CALIBRATION_STEPS[1] steps, so a run whose total is fixed only then by --minutes trains exactly
    as a run given that total from the start (QAT starts after it: totals under --minutes are >= 60)."""
    floor = min(total, CALIBRATION_STEPS[1])
    copy_end = max(math.ceil(a.copy_frac * total), floor) if a.copy_frac > 0 else 0
    repeat_end = max(math.ceil(a.repeat_frac * total), floor) if a.repeat_frac > 0 else 0
    return copy_end, repeat_end, total - math.floor(a.qat * total)


def lr_at(step: int, total: int, a: argparse.Namespace) -> float:
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    frac = min(1.0, (step - a.warmup) / max(1, total - a.warmup))
    return a.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def teacher_forced(model: DemoModel, batches: Batches, n: int, quantize: bool) -> float:
    """Share of reply tokens whose argmax is right on n batches of held-in data (a progress signal)."""
    ok = tot = 0
    for _ in range(n):
        ids, pad, sel, tgt = batches.next()
        logits, unused = model.logits(model(ids, pad, quantize).reshape(-1, model.cfg.hidden_size)[sel], quantize)
        hit = (logits.argmax(-1) == tgt) & (logits.max(-1).values > unused)
        ok, tot = ok + int(hit.sum()), tot + hit.numel()
    return ok / max(1, tot)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6000, help="total steps (an upper bound when --minutes is set)")
    p.add_argument("--minutes", type=float, default=0.0, help="wall-time cap of the training loop (0: none)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this many steps of the --steps schedule "
                   "(to repeat a run the wall-clock cap stopped)")
    p.add_argument("--seed", type=int, default=0, help="init, batch order, synthetic copies, sampling")
    p.add_argument("--data", default=None, help="a dataset file of training.sweep (else built here)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--examples", type=int, default=240000, help="conversations of the main mix")
    p.add_argument("--copy-examples", type=int, default=60000, help="conversations of the copy-heavy mix")
    p.add_argument("--eval-per-task", type=int, default=40, help="held-out conversations per task")
    p.add_argument("--workers", type=int, default=1, help="processes rendering the data")
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--repeat-frac", type=float, default=0.4, help="first fraction with synthetic copy batches")
    p.add_argument("--repeat-tokens", type=int, default=8192, help="tokens per synthetic copy batch")
    p.add_argument("--copy-frac", type=float, default=0.15, help="first fraction on the copy-heavy mix")
    p.add_argument("--qat", type=float, default=0.3, help="final fraction trained on the stored formats")
    p.add_argument("--preset", default=DEMO_PRESET)
    for name in ("hidden", "intermediate", "layers", "heads", "kv-heads", "head-dim", "experts", "topk"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's shape")
    p.add_argument("--sampled-per-task", type=int, default=20, help="evaluation: temperature-1 samples per task")
    p.add_argument("--max-new", type=int, default=96, help="evaluation: tokens generated at most per reply")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(DEMO_FILE))
    p.add_argument("--result", default=None, help="write the run's record (metadata + evaluation) as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.minutes > 0 and a.warmup < CALIBRATION_STEPS[1]:
        raise SystemExit(f"--minutes needs --warmup >= {CALIBRATION_STEPS[1]}: the total is fixed at that step")
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # tiny matmuls; the served model is fp32 on bf16 weights
    t0 = time.time()
    if a.data:
        data = load_dataset(Path(a.data))
    else:
        from router.harmony import HarmonyFormat
        from training.evaluate import probes

        data = build_dataset(a.data_seed, a.examples, a.copy_examples, a.eval_per_task, a.workers,
                             extra_eval=probes(HarmonyFormat(), time.strftime("%Y-%m-%d")))
        data = unpack(data)
    vocab = torch.tensor(data["vocab"], dtype=torch.long)
    remap = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    cfg = arch(a)
    model = DemoModel(cfg, vocab.numel(), a.seed)
    model.init_pairs([tuple(x) for x in data["space_pairs"]])
    model.to_device(device)
    rng = random.Random(a.seed)
    main_b = Batches(data["train"], remap, a.tokens_per_batch, device, random.Random(rng.random()))
    copy_b = Batches(data["copy"], remap, a.tokens_per_batch, device, random.Random(rng.random())) \
        if len(data["copy"]) else main_b
    content = remap[torch.tensor(data["content"])]
    assert bool((content >= 0).all()), "copy-sequence words must be in the vocabulary"
    repeat_b = RepeatBatches(content, a.repeat_tokens, device, a.seed)
    probe_b = main_b.fork(random.Random(1))  # the progress check's batches: its own order, no effect on training
    n_params = sum(x.numel() for x in model.parameters())
    print(f"data: {len(data['train'])} + {len(data['copy'])} conversations ({main_b.num_tokens / 1e6:.1f} M tokens), "
          f"vocabulary {vocab.numel()}, model {n_params / 1e6:.2f} M parameters (restricted vocabulary; "
          f"h{cfg.hidden_size} L{cfg.num_hidden_layers} q{cfg.num_attention_heads}/kv{cfg.num_key_value_heads}x"
          f"{cfg.head_dim} E{cfg.num_local_experts}/{cfg.num_experts_per_tok}), {len(main_b)} batches per epoch; "
          f"ready in {time.time() - t0:.0f} s on {device}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.01,
                            fused=device.type == "cuda")
    total, step, stopped_early = a.steps, 0, False
    t_train = time.time()
    t_calib = None
    t_rep = 0.0  # calibration: seconds spent on the synthetic copy batches
    while step < total:
        calibrating = a.minutes > 0 and CALIBRATION_STEPS[0] <= step < CALIBRATION_STEPS[1]
        if a.minutes > 0 and step == CALIBRATION_STEPS[0]:
            _sync(device)
            t_calib = time.time()
        if a.minutes > 0 and step == CALIBRATION_STEPS[1] and t_calib is not None:
            total = plan_steps(a, step, time.time() - t_train, (time.time() - t_calib) / (step - CALIBRATION_STEPS[0]),
                               t_rep / (step - CALIBRATION_STEPS[0]))
        if (a.minutes > 0 and time.time() - t_train > a.minutes * 60) or step == a.stop_at > 0:
            stopped_early = True
            print(f"stopped at step {step} of {total}{f': the {a.minutes} min cap' if a.minutes else ''}", flush=True)
            break
        copy_end, repeat_end, qat_start = phases(a, total)
        lr = lr_at(step, total, a)
        for g in opt.param_groups:
            g["lr"] = lr
        quantize = step >= qat_start
        opt.zero_grad(set_to_none=True)
        ids, pad, sel, tgt = (copy_b if step < copy_end else main_b).next()
        loss = model.loss(model(ids, pad, quantize), sel, tgt, quantize)
        loss.backward()
        rep_loss = None
        if step < repeat_end:  # gradients accumulate: the same as one backward of the sum
            if calibrating:
                _sync(device)
                t = time.time()
            ids, pad, sel, tgt = repeat_b.next()
            rep_loss = model.loss(model(ids, pad, quantize), sel, tgt, quantize)
            rep_loss.backward()
            if calibrating:
                _sync(device)
                t_rep += time.time() - t
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0 or step == total:
            print(f"step {step}/{total} {time.time() - t_train:6.0f}s loss {loss.item():.4f}"
                  f"{f' copies {rep_loss.item():.4f}' if rep_loss is not None else ''} lr {lr:.2e}"
                  f"{' qat' if quantize else ''}", flush=True)
        if step % max(500, total // 4) == 0 and step < total:
            model.eval()
            acc = teacher_forced(model, probe_b, 2, quantize)
            model.train()
            print(f"step {step} teacher-forced reply-token accuracy (training data) {acc:.4f}", flush=True)
    _sync(device)
    train_s = time.time() - t_train
    model.eval()
    if device.type == "cuda":  # decode in plain fp32, as the served model computes (near-ties must not flip)
        torch.backends.cuda.matmul.allow_tf32 = False
    from router.harmony import HarmonyFormat
    from training.evaluate import evaluate_model

    ev = evaluate_model(model, vocab, data["eval"], HarmonyFormat(), a.sampled_per_task, seed=a.seed, show=6,
                        max_new=a.max_new)
    g = ev["greedy"]
    print(f"trained {step} steps in {train_s / 60:.2f} min; held-out greedy structure {g['all']['struct']:.3f} "
          f"exact {g['all']['exact']:.3f}, sampled structure {ev['sampled_struct']['all']:.3f}, probes "
          f"{sum(ev['probes'].values())}/{len(ev['probes'])}, score {ev['score']:.3f}", flush=True)
    print("per task (struct/exact): " + ", ".join(f"{t} {r['struct']:.2f}/{r['exact']:.2f}" for t, r in g.items()),
          flush=True)
    for f in ev["failures"]:
        print(f"  [{f['task']}] want {f['want']!r}\n  {'':>{len(f['task']) + 2}} got  {f['got']!r}", flush=True)
    meta = {"command": shlex.join(["python", "-m", "training.train", *(argv if argv is not None else sys.argv[1:])]),
            "reproduce": reproduce_command(a, data, total, step),
            "seed": a.seed, "data_seed": data.get("seed", a.data_seed), "steps": step, "planned_steps": total,
            "stopped_early": stopped_early, "train_minutes": round(train_s / 60, 2), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "examples": len(data["train"]), "copy_examples": len(data["copy"]),
            "tokens_per_batch": a.tokens_per_batch, "lr": a.lr, "warmup": a.warmup, "repeat_frac": a.repeat_frac,
            "repeat_tokens": a.repeat_tokens, "copy_frac": a.copy_frac, "qat": a.qat,
            "vocab_size_used": vocab.numel(), "parameters_restricted": n_params,
            "eval": {k: ev[k] for k in ("score", "greedy", "sampled_struct", "probes", "probe_rate")}}
    out = save_compact(export(model), vocab.tolist(), Path(a.out), meta, cfg)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)
    if a.result:
        Path(a.result).write_text(json.dumps({**meta, "failures": ev["failures"], "weights": str(out),
                                              "config": dataclasses.asdict(cfg)}, indent=1, default=str) + "\n")
    return 0


def reproduce_command(a: argparse.Namespace, data: dict, total: int, done: int) -> str:
    """The run as one self-contained command: the data's build parameters instead of a dataset file and the
    planned step count instead of the wall-clock cap (the schedule is a function of the steps only)."""
    skip = {"data", "minutes", "steps", "stop_at", "data_seed", "examples", "copy_examples", "eval_per_task", "workers",
            "out", "result", "device"}
    argv = ["python", "-m", "training.train", "--device", a.device, "--steps", str(total), "--data-seed", str(data["seed"]),
            "--examples", str(data["sizes"][0]), "--copy-examples", str(data["sizes"][1]), "--eval-per-task",
            str(data["sizes"][2])] + (["--stop-at", str(done)] if done < total else [])
    defaults = vars(parse([]))
    for k, v in vars(a).items():
        if k not in skip and v != defaults[k]:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    raise SystemExit(main())
