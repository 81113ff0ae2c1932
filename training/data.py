"""Token ids of the synthetic conversations, rendered exactly as the router renders them.

The prompt is `router.harmony.HarmonyFormat.render(ChatPrompt)`: the very function the chat and
Responses endpoints call, so the system message (identity, knowledge cutoff, current date,
reasoning effort, channels), the developer message (instructions, tool declarations) and the
history carry the same ids at serving time. The reply is the assistant's harmony messages rendered
by openai-harmony, minus the `<|start|>assistant` the prompt already ends with; a final answer
ends with `<|return|>`, a function call with `<|call|>` (the engine's stop tokens).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from openai_harmony import Message, Role

from router.harmony import HarmonyFormat
from router.tokenizer import END, RETURN, START
from training.tasks import CITIES, CONDITIONS, CURRENCIES, NAMES, SYMBOLS, WORDS, Conv, Part, sample_conv


@dataclass(slots=True)
class Example:
    task: str
    prompt: list[int]
    reply: list[int]


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
    return Example(conv.task, fmt.render(conv.prompt), reply_ids(fmt, conv.reply))


def make_examples(fmt: HarmonyFormat, seed: int, n: int, task: str | None = None,
                  date: str | None = None, weights: dict[str, float] | None = None) -> list[Example]:
    r = random.Random(seed)
    return [encode(fmt, sample_conv(r, task, date, weights)) for _ in range(n)]


def held_out(fmt: HarmonyFormat, train: list[Example], seed: int, n_per_task: int, tasks: list[str],
             date: str | None = None) -> list[Example]:
    """Fresh conversations (another seed) whose prompt is not one of the training prompts."""
    seen = {tuple(e.prompt) for e in train}
    out = []
    for i, task in enumerate(tasks):
        got = 0
        for e in make_examples(fmt, seed * 1000 + i, 4 * n_per_task, task, date):
            if tuple(e.prompt) not in seen and got < n_per_task:
                out.append(e)
                got += 1
    return out


def space_pairs(fmt: HarmonyFormat, vocab: list[int]) -> list[tuple[int, int]]:
    """(index of " w", index of "w") in `vocab` for every word, name and city: the same word with and
    without its leading space, which the model copies into each other (see DemoModel.init_pairs)."""
    index = {t: i for i, t in enumerate(vocab)}
    out = []
    for w in (*WORDS, *NAMES, *CITIES, *CONDITIONS, *SYMBOLS, *CURRENCIES, *(n.lower() for n in NAMES)):
        a, b = fmt.encoding.encode(" " + w, allowed_special=()), fmt.encoding.encode(w, allowed_special=())
        if len(a) == len(b) == 1 and a[0] in index and b[0] in index:
            out.append((index[a[0]], index[b[0]]))
    return out


def vocabulary(fmt: HarmonyFormat, examples: list[Example]) -> list[int]:
    """Every token id the data uses, plus the words, names and cities alone and after a space (so
    echo and extraction tasks see each spelling), sorted."""
    ids = {t for e in examples for t in e.prompt + e.reply}
    for w in (*WORDS, *NAMES, *CITIES, *CONDITIONS, *SYMBOLS, *CURRENCIES, *(n.lower() for n in NAMES)):
        for s in (w, " " + w, w.capitalize(), " " + w.capitalize()):
            ids.update(fmt.encoding.encode(s, allowed_special=()))
    for n in range(1000):  # every 1-3 digit number token
        ids.update(fmt.encoding.encode(str(n), allowed_special=()))
    return sorted(ids)
