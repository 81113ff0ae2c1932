"""Token ids of the synthetic conversations, rendered exactly as the router renders them.

The prompt is `router.harmony.HarmonyFormat.render(ChatPrompt)`: the very function the chat and
Responses endpoints call, so the system message (identity, knowledge cutoff, current date,
reasoning effort, channels), the developer message (instructions, tool declarations) and the
history carry the same ids at serving time. The reply is the assistant's harmony messages rendered
by openai-harmony, minus the `<|start|>assistant` the prompt already ends with; a final answer
ends with `<|return|>`, a function call with `<|call|>` (the engine's stop tokens).

`build_dataset` renders a whole training set once, in parallel worker processes (a fixed chunking,
so the result does not depend on the worker count), into flat tensors that `training.train`
processes load without openai-harmony: the training mix, the copy-heavy mix, held-out evaluation
conversations (whose prompts are not training prompts) and the vocabulary the data uses.
"""

from __future__ import annotations

import hashlib
import random
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch
from openai_harmony import Message, Role

from router.harmony import HarmonyFormat
from router.tokenizer import END, RETURN, START
from training.tasks import CITIES, CONDITIONS, CURRENCIES, NAMES, SYMBOLS, WORDS, Conv, Part, sample_conv

EVAL_TASKS = ["greet", "about", "math", "echo", "json", "other", "tool", "tool_res"]
CHUNK = 2500  # conversations per generation job: the unit of the fixed chunking


@dataclass(slots=True)
class Example:
    task: str
    prompt: list[int]
    reply: list[int]
    # Declared functions: (name, parameter names, required names); what a call must respect.
    tools: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = ()


def reply_ids(fmt: HarmonyFormat, parts: list[Part]) -> list[int]:
    """The generated side of a turn: `<|channel|>analysis<|message|>...<|end|><|start|>assistant...`."""
    out: list[int] = []
    for i, p in enumerate(parts):
        m = Message.from_role_and_content(Role.ASSISTANT, p.text).with_channel(p.channel)
        if p.recipient is not None:
            m = m.with_recipient(p.recipient).with_content_type("<|constrain|>json")
        ids = fmt.encoding.render(m)
        assert ids[0] == START
        if i == 0:
            ids = ids[2:]  # the prompt ends with `<|start|>assistant`
        out += ids
    if parts[-1].channel == "final":
        assert out[-1] == END
        out[-1] = RETURN
    return out


def encode(fmt: HarmonyFormat, conv: Conv) -> Example:
    tools = tuple((t.name, tuple((t.parameters or {}).get("properties", {})),
                   tuple((t.parameters or {}).get("required", []))) for t in conv.prompt.tools)
    return Example(conv.task, fmt.render(conv.prompt), reply_ids(fmt, conv.reply), tools)


def make_examples(fmt: HarmonyFormat, seed: int, n: int, task: str | None = None,
                  date: str | None = None, weights: dict[str, float] | None = None) -> list[Example]:
    r = random.Random(seed)
    return [encode(fmt, sample_conv(r, task, date, weights)) for _ in range(n)]


def prompt_key(ids: list[int]) -> bytes:
    return hashlib.blake2b(torch.tensor(ids, dtype=torch.int32).numpy().tobytes(), digest_size=8).digest()


def space_pairs(fmt: HarmonyFormat, vocab: list[int]) -> list[tuple[int, int]]:
    """(index of " w", index of "w") in `vocab` for every word, name and city: the same word with and
    without its leading space, which the model copies into each other (see DemoModel.init_pairs)."""
    index = {t: i for i, t in enumerate(vocab)}
    out = []
    for w in _LEXICON:
        a, b = fmt.encoding.encode(" " + w, allowed_special=()), fmt.encoding.encode(w, allowed_special=())
        if len(a) == len(b) == 1 and a[0] in index and b[0] in index:
            out.append((index[a[0]], index[b[0]]))
    return out


_LEXICON = (*WORDS, *NAMES, *CITIES, *CONDITIONS, *SYMBOLS, *CURRENCIES, *(n.lower() for n in NAMES))


def lexicon_ids(fmt: HarmonyFormat) -> tuple[set[int], set[int]]:
    """(every id of the words, names, cities and numbers in every spelling the data uses, the
    single-token content words among them: what the synthetic copy sequences are made of)."""
    ids, content = set(), set()
    for w in _LEXICON:
        for s in (w, " " + w, w.capitalize(), " " + w.capitalize()):
            t = fmt.encoding.encode(s, allowed_special=())
            ids.update(t)
            if len(t) == 1 and s.startswith(" "):
                content.update(t)
    for n in range(1000):  # every 1-3 digit number token
        ids.update(fmt.encoding.encode(str(n), allowed_special=()))
        if n < 100:
            content.update(fmt.encoding.encode(" " + str(n), allowed_special=()))
    return ids | content, content


def vocabulary(fmt: HarmonyFormat, examples: list[Example]) -> list[int]:
    """Every token id the examples use, plus the lexicon in every spelling, sorted."""
    return sorted({t for e in examples for t in e.prompt + e.reply} | lexicon_ids(fmt)[0])


# ---- packed datasets ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Packed:
    """Conversations as flat tensors (o200k ids): example i is tokens[offsets[i]:offsets[i+1]], its
    first prompt_len[i] tokens the prompt, the rest the reply."""

    tokens: torch.Tensor  # [sum of lengths] int32
    offsets: torch.Tensor  # [N + 1] int64
    prompt_len: torch.Tensor  # [N] int32
    task: torch.Tensor  # [N] int8, index into EVAL_TASKS

    def __len__(self) -> int:
        return self.prompt_len.numel()

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "offsets": self.offsets, "prompt_len": self.prompt_len, "task": self.task}


def pack(examples: list[Example]) -> Packed:
    lens = torch.tensor([len(e.prompt) + len(e.reply) for e in examples], dtype=torch.int64).reshape(-1)
    offsets = torch.zeros(len(examples) + 1, dtype=torch.int64)
    offsets[1:] = lens.cumsum(0)
    tokens = torch.tensor([t for e in examples for t in e.prompt + e.reply], dtype=torch.int32).reshape(-1)
    return Packed(tokens, offsets, torch.tensor([len(e.prompt) for e in examples], dtype=torch.int32).reshape(-1),
                  torch.tensor([EVAL_TASKS.index(e.task) for e in examples], dtype=torch.int8).reshape(-1))


def _job(args: tuple[int, int, dict[str, float] | None]) -> tuple[dict, list[bytes]]:
    seed, n, weights = args
    ex = make_examples(_fmt(), seed, n, weights=weights)
    return pack(ex).as_dict(), [prompt_key(e.prompt) for e in ex]


_FMT: list[HarmonyFormat] = []


def _fmt() -> HarmonyFormat:
    if not _FMT:
        _FMT.append(HarmonyFormat())
    return _FMT[0]


def _concat(parts: list[dict]) -> Packed:
    if not parts:
        return pack([])
    lens = [p["offsets"][1:] - p["offsets"][:-1] for p in parts]
    lengths = torch.cat(lens)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return Packed(torch.cat([p["tokens"] for p in parts]), offsets, torch.cat([p["prompt_len"] for p in parts]),
                  torch.cat([p["task"] for p in parts]))


def build_dataset(seed: int, n_train: int, n_copy: int, eval_per_task: int, workers: int = 1,
                  extra_eval: list[Example] | None = None) -> dict:
    """The whole data of one training run, deterministic in (seed, sizes): conversations are drawn in
    jobs of CHUNK, job j of the main mix from seed (seed, j), of the copy-heavy mix from (seed, 'copy', j)."""
    from training.tasks import COPY_WEIGHTS

    jobs = [(seed * 1_000_003 + j, min(CHUNK, n_train - j * CHUNK), None) for j in range((n_train + CHUNK - 1) // CHUNK)]
    jobs += [(seed * 1_000_003 + 500_000 + j, min(CHUNK, n_copy - j * CHUNK), COPY_WEIGHTS)
             for j in range((n_copy + CHUNK - 1) // CHUNK)]
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_job, jobs))
    else:
        results = [_job(j) for j in jobs]
    n_main = (n_train + CHUNK - 1) // CHUNK
    seen = {k for _, keys in results for k in keys}
    fmt = _fmt()
    evals = held_out(fmt, seen, seed + 1, eval_per_task, EVAL_TASKS) + list(extra_eval or [])
    train, copy = _concat([r for r, _ in results[:n_main]]), _concat([r for r, _ in results[n_main:]])
    lex, content = lexicon_ids(fmt)
    used = set(torch.unique(train.tokens).tolist()) | set(torch.unique(copy.tokens).tolist()) | lex
    used |= {t for e in evals for t in e.prompt + e.reply}
    vocab = sorted(used)
    return {"seed": seed, "sizes": (n_train, n_copy, eval_per_task), "vocab": vocab, "content": sorted(content), "train": train.as_dict(), "copy": copy.as_dict(),
            "eval": [{"task": e.task, "prompt": e.prompt, "reply": e.reply, "tools": e.tools} for e in evals],
            "space_pairs": space_pairs(fmt, vocab)}


def held_out(fmt: HarmonyFormat, seen: set[bytes], seed: int, n_per_task: int, tasks: list[str],
             date: str | None = None) -> list[Example]:
    """Fresh conversations (another seed) whose prompt is not one of the training prompts."""
    out = []
    for i, task in enumerate(tasks):
        got = 0
        for e in make_examples(fmt, seed * 1000 + i, 4 * n_per_task, task, date):
            if prompt_key(e.prompt) not in seen and got < n_per_task:
                out.append(e)
                got += 1
    return out


def save_dataset(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, str(path))
    return path


def load_dataset(path: Path) -> dict:
    return unpack(torch.load(str(path), weights_only=False))


def unpack(data: dict) -> dict:
    """build_dataset's (saved) dict -> the same with Packed mixes and Example evaluation rows."""
    data = dict(data)
    for k in ("train", "copy"):
        data[k] = Packed(**data[k])
    data["eval"] = examples_from(data["eval"])
    return data


def examples_from(rows: list[dict]) -> list[Example]:
    """build_dataset's JSON-able eval rows -> Examples."""
    return [Example(e["task"], e["prompt"], e["reply"], tuple((n, tuple(p), tuple(r)) for n, p, r in e["tools"]))
            for e in rows]
