"""How well a demo model answers: structure first, then exact answers.

Per held-out conversation (prompts not among the training prompts) and per task:
  * structure: the reply is `<|channel|>analysis<|message|>TEXT<|end|><|start|>assistant` then
    either `<|channel|>final<|message|>TEXT<|return|>` (a json task's TEXT parses as JSON) or a call
    ` to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>ARGS<|call|>` where NAME is a
    declared function and ARGS a JSON object with its required and only its declared parameters;
  * exact: every generated id equals the expected reply, stop token included.
Greedy decoding gives both; sampling at temperature 1 (the API's default, what the README example
does) gives the structure rate under sampling, i.e. how often an answer ends. `PROBES` are the
conversations the integration tests send (README example, tool-call round trips in chat and in
Responses), checked exactly.

Two decoders: `decode` runs the training model (training.model, stored number formats) on any
device, for the sweep; `python -m training.evaluate [--weights FILE]` expands a compact file into
the HF layout and decodes with the single-process engine (engine.llm.LLM: bf16 weights, MXFP4
experts, fp32 compute, exactly what the workers run), on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from router.chat_types import ChatMessage, ChatPrompt, ToolCall, ToolDef
from router.harmony import HarmonyFormat
from router.tokenizer import CALL, RETURN
from training.data import Example, encode, examples_from
from training.tasks import Conv, Part

UNUSED = -1  # a decoded token outside the trained vocabulary (the shared unused logit won)
_TEXT = r"((?:(?!<\|).)+)"  # message text: non-empty, no special token
_FINAL = re.compile(rf"<\|channel\|>analysis<\|message\|>{_TEXT}<\|end\|><\|start\|>assistant"
                    rf"<\|channel\|>final<\|message\|>{_TEXT}<\|return\|>", re.S)
_CALL = re.compile(rf"<\|channel\|>analysis<\|message\|>{_TEXT}<\|end\|><\|start\|>assistant to=functions\."
                   rf"([A-Za-z0-9_-]+)<\|channel\|>commentary <\|constrain\|>json<\|message\|>{_TEXT}<\|call\|>", re.S)


def check(fmt: HarmonyFormat, e: Example, out: list[int]) -> tuple[bool, bool]:
    """-> (structure ok, exact) of one generated reply (o200k ids, UNUSED for an untrained token)."""
    exact = out == e.reply
    if UNUSED in out or not out or out[-1] not in (RETURN, CALL):
        return False, exact
    try:
        text = fmt.encoding.decode(out)
    except Exception:  # noqa: BLE001 - undecodable output is simply not well formed
        return False, exact
    expects_call = e.reply[-1] == CALL
    m = (_CALL if expects_call else _FINAL).fullmatch(text)
    if m is None:
        return False, exact
    if not expects_call:
        if e.task == "json" or e.task.startswith("probe-json"):
            try:
                json.loads(m.group(2))
            except ValueError:
                return False, exact
        return True, exact
    declared = {name: (set(params), set(req)) for name, params, req in e.tools}
    try:
        args = json.loads(m.group(3))
    except ValueError:
        return False, exact
    ok = (m.group(2) in declared and isinstance(args, dict) and declared[m.group(2)][1] <= set(args)
          <= declared[m.group(2)][0])
    return ok, exact


# ---- the integration tests' conversations ----------------------------------------------------------
WEATHER = ToolDef("get_weather", "Get the current weather for a city",
                  {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
_GREET = [Part("analysis", "The user greets me. I greet them back."), Part("final", "Hello! How can I help you today?")]


def _weather_call(city: str) -> list[Part]:
    return [Part("analysis", f"The user wants the weather in {city}. I call get_weather."),
            Part("commentary", json.dumps({"city": city}, separators=(",", ":")), "functions.get_weather")]


def _round_trip(city: str, temp: int, cond: str, effort: str, keep_reasoning: bool) -> ChatPrompt:
    call = ToolCall("call_0123456789ab", "get_weather", json.dumps({"city": city}, separators=(",", ":")))
    reasoning = f"The user wants the weather in {city}. I call get_weather." if keep_reasoning else None
    msgs = [ChatMessage("user", f"What's the weather in {city}?"),
            ChatMessage("assistant", "", reasoning=reasoning, tool_calls=[call]),
            ChatMessage("tool", json.dumps({"temperature_c": temp, "condition": cond}), tool_call_id=call.id)]
    return ChatPrompt(msgs, tools=[WEATHER], reasoning_effort=effort)


def probes(fmt: HarmonyFormat, date: str) -> list[Example]:
    """What tests/integration/test_demo_model.py and test_demo_checkpoint.py send, with the replies
    they expect (the chat test sends the reasoning back, Responses keeps it: both spellings)."""
    def ex(name: str, prompt: ChatPrompt, reply: list[Part]) -> Example:
        prompt.current_date = date
        return encode(fmt, Conv(f"probe-{name}", prompt, reply))

    out = [ex("hi", ChatPrompt([ChatMessage("user", "hi")]), _GREET),
           ex("hi-brief", ChatPrompt([ChatMessage("developer", "Be brief."), ChatMessage("user", "hi")]), _GREET),
           ex("math", ChatPrompt([ChatMessage("user", "What is 12+7?")]),
              [Part("analysis", "Compute 12 + 7. 12 + 7 = 19."), Part("final", "12 + 7 = 19.")]),
           ex("echo", ChatPrompt([ChatMessage("user", "Repeat after me: green apple")]),
              [Part("analysis", "The user wants me to repeat: green apple"), Part("final", "green apple")]),
           ex("json", ChatPrompt([ChatMessage("user", "Give me a JSON object with name Alice and age 30.")]),
              [Part("analysis", "The user wants a JSON object with a name and an age."),
               Part("final", json.dumps({"name": "Alice", "age": 30}))]),
           ex("call-paris", ChatPrompt([ChatMessage("user", "What's the weather in Paris?")], tools=[WEATHER]),
              _weather_call("Paris")),
           ex("call-tokyo", ChatPrompt([ChatMessage("user", "What's the weather in Tokyo?")], tools=[WEATHER],
                                       reasoning_effort="low"), _weather_call("Tokyo"))]
    for city, temp, cond, effort in (("Paris", 21, "clear", "medium"), ("Tokyo", 8, "cold", "low")):
        for keep in (True, False):
            out.append(ex(f"result-{city.lower()}{'' if keep else '-noreason'}",
                          _round_trip(city, temp, cond, effort, keep),
                          [Part("analysis", f"The tool says {cond} and {temp}°C."),
                           Part("final", f"It is {cond} and {temp}°C in {city}.")]))
    return out


# ---- decoding with the training model -----------------------------------------------------------------
@torch.no_grad()
def decode(model, prompts: list[list[int]], vocab: torch.Tensor, max_new: int = 96, temperature: float = 0.0,
           seed: int = 0, batch: int = 64, quantize: bool = True) -> list[list[int]]:
    """Generate from restricted-vocabulary prompts (o200k ids in, o200k ids out) as the served model
    would: left-padded batches, full recompute per token, stop at <|return|> / <|call|>. The unused
    tokens compete as one logit (greedy) or one category of mass (V - n) * exp(logit) (sampling)."""
    device = next(model.parameters()).device
    remap = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    stops = torch.tensor([int(remap[RETURN]), int(remap[CALL])], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    n = vocab.numel()
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        p = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), p + max_new, dtype=torch.long)
        pad = torch.ones(len(chunk), p + max_new, dtype=torch.bool)
        for b, x in enumerate(chunk):
            ids[b, p - len(x):p] = remap[torch.tensor(x)]
            pad[b, p - len(x):p] = False
        ids, pad = ids.to(device), pad.to(device)
        done = torch.zeros(len(chunk), dtype=torch.bool, device=device)
        gen_ids = torch.full((len(chunk), max_new), -2, dtype=torch.long, device=device)
        for t in range(max_new):
            hidden = model(ids[:, :p + t], pad[:, :p + t], quantize)[:, -1]
            logits, unused = model.logits(hidden, quantize)
            full = torch.cat([logits, (unused + (model.log_unused if temperature > 0 else 0.0))[:, None]], -1)
            if temperature > 0:
                probs = torch.softmax(full / temperature, -1)
                nxt = torch.multinomial(probs, 1, generator=gen)[:, 0]
            else:
                nxt = full.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, -2), nxt)
            gen_ids[:, t] = nxt
            ids[:, p + t] = nxt.clamp(0, n - 1)
            pad[:, p + t] = False
            done |= (nxt == n) | torch.isin(nxt, stops)
            if t % 8 == 7 and bool(done.all()):
                break
        for row in gen_ids.tolist():
            toks = [x for x in row if x != -2]
            out.append([UNUSED if x == n else int(vocab[x]) for x in toks])
    return out


def score_outputs(fmt: HarmonyFormat, examples: list[Example], outs: list[list[int]]) -> dict[str, dict[str, float]]:
    """-> {task: {"exact": rate, "struct": rate}} plus "all" (the mean over tasks)."""
    by: dict[str, list[tuple[bool, bool]]] = {}
    for e, o in zip(examples, outs, strict=True):
        by.setdefault(e.task, []).append(check(fmt, e, o))
    res = {t: {"struct": round(sum(s for s, _ in v) / len(v), 4), "exact": round(sum(x for _, x in v) / len(v), 4)}
           for t, v in sorted(by.items())}
    res["all"] = {k: round(sum(r[k] for r in res.values()) / max(1, len(res)), 4) for k in ("struct", "exact")}
    return res


def evaluate_model(model, vocab: torch.Tensor, examples: list[Example], fmt: HarmonyFormat,
                   sampled_per_task: int = 20, seed: int = 0, show: int = 0, max_new: int = 96) -> dict:
    """Greedy on every held-out example and probe, sampling (T=1) on the first `sampled_per_task` of
    each task; the sweep's selection score (structure counts twice; see module docstring)."""
    held = [e for e in examples if not e.task.startswith("probe-")]
    probe = [e for e in examples if e.task.startswith("probe-")]
    t0 = time.time()
    outs = decode(model, [e.prompt for e in held + probe], vocab, max_new)
    greedy = score_outputs(fmt, held, outs[:len(held)])
    probe_ok = {e.task[len("probe-"):]: check(fmt, e, o)[1] for e, o in zip(probe, outs[len(held):], strict=True)}
    counts: dict[str, int] = {}
    sample_set = []
    for e in held:
        if counts.get(e.task, 0) < sampled_per_task:
            counts[e.task] = counts.get(e.task, 0) + 1
            sample_set.append(e)
    sampled = score_outputs(fmt, sample_set, decode(model, [e.prompt for e in sample_set], vocab, max_new,
                                                       temperature=1.0, seed=seed)) if sample_set else {"all": {"struct": 0.0}}
    failures = []
    for e, o in zip(held, outs, strict=False):
        if len(failures) >= show:
            break
        if o != e.reply:
            failures.append({"task": e.task, "want": _text(fmt, e.reply), "got": _text(fmt, o)})
    probe_rate = sum(probe_ok.values()) / max(1, len(probe_ok))
    score = 2 * greedy["all"]["struct"] + sampled["all"]["struct"] + greedy["all"]["exact"] + probe_rate
    return {"score": round(score, 4), "greedy": greedy, "sampled_struct": {t: r["struct"] for t, r in sampled.items()},
            "probes": probe_ok, "probe_rate": round(probe_rate, 4), "failures": failures,
            "eval_seconds": round(time.time() - t0, 1)}


def _text(fmt: HarmonyFormat, ids: list[int]) -> str:
    try:
        return fmt.encoding.decode([t for t in ids if t != UNUSED]) + ("<unused>" if UNUSED in ids else "")
    except Exception:  # noqa: BLE001
        return repr(ids)


# ---- the served checkpoint through the engine ---------------------------------------------------------
def engine_outputs(weights: Path, examples: list[Example], max_new: int = 96) -> list[list[int]]:
    from engine.build import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from model.checkpoint_io import write_demo_checkpoint

    params = SamplingParams(max_tokens=max_new, temperature=0, stop_token_ids=[RETURN, CALL])
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(EngineConfig(checkpoint=str(write_demo_checkpoint(Path(d) / "ckpt", weights)),
                               kv_cache_bytes=256 << 20))
        return [o.output_ids for o in llm.generate([e.prompt for e in examples], params)]


def main(argv: list[str] | None = None) -> int:
    from model.demo import DEMO_FILE, load_compact
    from training.data import build_dataset

    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default=str(DEMO_FILE))
    p.add_argument("--per-task", type=int, default=50)
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"), help="the probes' current date")
    p.add_argument("--show", type=int, default=10, help="print this many failures")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="to re-render the training prompts")
    a = p.parse_args(argv)
    _, meta, _ = load_compact(Path(a.weights))
    t0 = time.time()
    fmt = HarmonyFormat()
    data = build_dataset(meta["data_seed"], meta["examples"], meta["copy_examples"], a.per_task, a.workers,
                         extra_eval=probes(fmt, a.date))
    evals = examples_from(data["eval"])
    outs = engine_outputs(Path(a.weights), evals)
    held = [i for i, e in enumerate(evals) if not e.task.startswith("probe-")]
    res = score_outputs(fmt, [evals[i] for i in held], [outs[i] for i in held])
    probe_ok = {e.task[6:]: o == e.reply for e, o in zip(evals, outs) if e.task.startswith("probe-")}
    shown = 0
    for e, o in zip(evals, outs):
        if o != e.reply and shown < a.show:
            shown += 1
            print(f"[{e.task}] want {_text(fmt, e.reply)!r}\n   got  {_text(fmt, o)!r}")
    print(json.dumps({"weights": a.weights, "held_out_prompts": len(held), "greedy": res, "probes": probe_ok,
                      "sweep_metrics": meta.get("eval", {}).get("greedy", {}).get("all"),
                      "seconds": round(time.time() - t0)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
