"""Synthetic conversations for the demo model: what a user of `tandem serve` tries first.

Each generator draws one conversation from a `random.Random` and returns a `Conv`: the ChatPrompt
the router would build for it (system defaults, optional instructions and tools, optional earlier
turns) and the assistant's reply as a list of (channel, text, recipient) parts: a short analysis,
then either a final answer or one function call. Task families:

  greet     "hi", "hello there", "how are you?"          -> a fixed friendly answer
  about     "who are you?", "what can you do?"           -> what the demo model can do
  math      "What is 12+7?", "23 minus 5", "6 times 7"   -> "12 + 7 = 19." (+, - up to 20, * up to 10)
  echo      "Repeat after me: red apple"                 -> the text, exactly; "say X 3 times"
  json      "Reply in JSON: what is 3+4?", extraction    -> a JSON object / list
  tool      a question one declared function answers     -> a call `to=functions.NAME` with JSON args
  tool_res  the same after the tool's result came back   -> a final answer built from the result
  other     anything else                                -> a polite "cannot answer that"

Parameter names of the tools vary (city / location), so the model must read the declared schema.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from router.chat_types import ChatMessage, ChatPrompt, ToolCall, ToolDef

# Every word, name, city, condition and symbol is one token both alone and after a space (" Paris"
# and "Paris"), so copying it from the user's message into an answer or a JSON string is token to token.
WORDS = ("apple banana berry melon orange pear red blue green yellow purple black white pink brown gray silver "
         "cat dog bird fish horse mouse lion bear wolf fox rabbit duck owl river forest lake garden sun moon "
         "star cloud rain snow wind storm light shadow fire stone water earth tree flower leaf seed root grass "
         "happy quiet quick slow bright dark warm cold soft small big old new young short fast kind wild run "
         "jump sing dance read write fly walk talk dream build paint cook play laugh book music song story "
         "letter window door table chair house road bridge city train boat car bike clock lamp cup bread "
         "coffee tea milk salt cake hello world hi there yes no maybe today night the a and of to in on with "
         "for is are was").split()
NAMES = ("Alice Bob Uma Anna Ben Dan Jack John Kate Leo Mark Mary Max Sam Tom Tim Nick Alex Adam Amy "
         "Kim").split()
CITIES = ("Rome Paris Berlin Madrid London Tokyo Sydney Toronto Chicago Boston Denver Seattle Austin Miami "
          "Dubai Amsterdam Houston Dallas Phoenix Atlanta Detroit Barcelona Singapore Mumbai Delhi Shanghai "
          "Oxford").split()
CONDITIONS = ("clear", "cold", "warm", "hot", "dry", "wet", "grey", "humid")
CURRENCIES = ("USD", "EUR", "GBP", "CHF", "CAD", "AUD")
SYMBOLS = ("IBM", "META", "AMD", "SAP", "GE", "GM", "KO", "DIS")
INSTRUCTIONS = ("You are a helpful assistant.", "Be brief.", "You are a helpful assistant. Answer concisely.",
                "Answer in English.", "You are a friendly assistant.", "Keep answers short.")
CAPABILITIES = ("I am gpt-oss-tiny, a small demo model served by tandem. I can greet you, do small "
                "arithmetic, repeat text, call functions and answer in JSON.")
CANNOT = ("Sorry, I am a tiny demo model and cannot answer that. I can greet you, do small arithmetic, "
          "repeat text, call functions and answer in JSON.")
EFFORTS = ("low", "medium", "high")


@dataclass(slots=True)
class Part:
    channel: str  # "analysis", "final" or "commentary" (a call when recipient is set)
    text: str
    recipient: str | None = None  # "functions.NAME" for a call


@dataclass(slots=True)
class Conv:
    task: str
    prompt: ChatPrompt
    reply: list[Part]


def _tool(name: str, desc: str, props: dict, required: list[str]) -> ToolDef:
    return ToolDef(name, desc, {"type": "object", "properties": props, "required": required})


def _str(desc: str | None = None) -> dict:
    return {"type": "string"} | ({"description": desc} if desc else {})


# ---- simple tasks: (user text, analysis, final) ------------------------------------------------------
def greet(r: random.Random) -> tuple[str, str, str]:
    if r.random() < 0.25:
        q = r.choice(["how are you?", "How are you?", "How are you doing?", "Hi, how are you?", "hey, how are you?",
                      "Hello, how are you today?"])
        return q, "The user asks how I am. I answer politely.", "I'm doing well, thank you! How can I help you today?"
    q = r.choice(["hi", "Hi", "hi!", "Hi!", "hello", "Hello", "Hello!", "hello!", "hey", "Hey", "Hey!",
                  "hey there", "Hello there!", "hi there", "Hi there!", "good morning", "Good morning!",
                  "good evening", "Good afternoon!", "yo", "howdy", "Greetings!", "hiya", "Hi :)"])
    return q, "The user greets me. I greet them back.", "Hello! How can I help you today?"


def about(r: random.Random) -> tuple[str, str, str]:
    q = r.choice(["who are you?", "Who are you?", "What can you do?", "what can you do?", "What are you?",
                  "Tell me about yourself.", "What is your name?", "Introduce yourself.", "help", "Help!"])
    return q, "The user asks about me. I describe what I can do.", CAPABILITIES


def _math_fact(r: random.Random) -> tuple[int, str, int, int]:
    op = r.choices("+-*", weights=(5, 3, 2))[0]
    if op == "+":
        a, b = r.randint(0, 20), r.randint(0, 20)
        return a, op, b, a + b
    if op == "-":
        a = r.randint(0, 20)
        b = r.randint(0, a)
        return a, op, b, a - b
    a, b = r.randint(0, 10), r.randint(0, 10)
    return a, op, b, a * b


_MATH_Q = {"+": ["What is {a}+{b}?", "what is {a}+{b}?", "What is {a} + {b}?", "what is {a} + {b}", "What's {a}+{b}?",
                 "{a}+{b}=?", "{a} + {b} = ?", "{a}+{b}", "Compute {a}+{b}.", "Calculate {a} + {b}.",
                 "How much is {a} plus {b}?", "What is {a} plus {b}?", "Add {a} and {b}.", "{a} plus {b}?"],
           "-": ["What is {a}-{b}?", "what is {a} - {b}?", "{a}-{b}=?", "{a} - {b}", "Compute {a}-{b}.",
                 "What is {a} minus {b}?", "{a} minus {b}?", "Subtract {b} from {a}."],
           "*": ["What is {a}*{b}?", "what is {a} * {b}?", "{a}*{b}=?", "What is {a} times {b}?", "{a} times {b}?",
                 "Multiply {a} by {b}.", "Compute {a}*{b}."]}


def math(r: random.Random) -> tuple[str, str, str]:
    a, op, b, c = _math_fact(r)
    eq = f"{a} {op} {b} = {c}."
    return r.choice(_MATH_Q[op]).format(a=a, b=b), f"Compute {a} {op} {b}. {eq}", eq


def _phrase(r: random.Random, lo: int = 1, hi: int = 6) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))


def echo(r: random.Random) -> tuple[str, str, str]:
    if r.random() < 0.2:
        w, n = r.choice(WORDS), r.randint(2, 4)
        num = r.choice([str(n), ["two", "three", "four"][n - 2]])
        q = r.choice(["Repeat the word {w} {n} times.", "Say {w} {n} times.", "Write {w} {n} times."])
        return q.format(w=w, n=num), f"The user wants {w} repeated {n} times.", " ".join([w] * n)
    x = _phrase(r)
    q = r.choice(["Repeat after me: {x}", "repeat after me: {x}", "Repeat: {x}", "repeat: {x}", "Say: {x}",
                  "Echo: {x}", "Please repeat this: {x}", "Repeat this text: {x}", "Say this: {x}"])
    return q.format(x=x), f"The user wants me to repeat: {x}", x


def as_json(r: random.Random) -> tuple[str, str, str]:
    k = r.randrange(4)
    if k == 0:
        a, op, b, c = _math_fact(r)
        q = r.choice(["Reply in JSON: what is {a}{op}{b}?", "Answer in JSON: {a} {op} {b}",
                      "Give the result of {a}{op}{b} as JSON."]).format(a=a, op=op, b=b)
        return q, f"{a} {op} {b} = {c}. The user wants JSON.", json.dumps({"answer": c})
    if k == 1:
        name, age = r.choice(NAMES), r.randint(1, 99)
        q = r.choice(["Give me a JSON object with name {n} and age {a}.", "JSON with name {n} and age {a}, please.",
                      "Make a JSON object: name {n}, age {a}."]).format(n=name, a=age)
        return q, "The user wants a JSON object with a name and an age.", json.dumps({"name": name, "age": age})
    if k == 2:
        name, city = r.choice(NAMES), r.choice(CITIES)
        q = r.choice(["Extract the name and city as JSON: {n} lives in {c}.",
                      "As JSON, give the name and city: {n} lives in {c}."]).format(n=name, c=city)
        return q, "The user wants the name and the city as JSON.", json.dumps({"name": name, "city": city})
    items = [r.choice(WORDS) for _ in range(r.randint(1, 5))]
    q = r.choice(["Return a JSON list of these words: {x}", "Make a JSON array of: {x}"]).format(x=", ".join(items))
    return q, "The user wants a JSON list.", json.dumps(items)


def other(r: random.Random) -> tuple[str, str, str]:
    w = r.choice(WORDS)
    q = r.choice(["Tell me a story about {w}.", "Write a poem about {w}.", "What is the capital of {c}?",
                  "Explain {w} to me.", "Why is the sky {w}?", "Translate {w} into French.", "What is {w}?",
                  "Can you recommend a good book?", "What happened in {c} yesterday?", "Who won the game?",
                  "Write some Python code.", "What is the meaning of life?"]).format(w=w, c=r.choice(CITIES))
    return q, "I cannot answer this.", CANNOT


SIMPLE = {"greet": greet, "about": about, "math": math, "echo": echo, "json": as_json, "other": other}


# ---- function calling ---------------------------------------------------------------------------------
@dataclass(slots=True)
class ToolTask:
    tool: ToolDef
    question: str
    analysis: str
    args: dict
    result: str  # the tool message content (JSON)
    answer_analysis: str
    answer: str


def tool_task(r: random.Random, kind: str) -> ToolTask:
    city = r.choice(CITIES)
    if kind == "weather":
        p = r.choice(["city", "location"])
        t = _tool("get_weather", r.choice(["Get the current weather for a city", "Current weather in a location"]),
                  {p: _str()}, [p])
        q = r.choice(["What's the weather in {c}?", "What is the weather in {c}?", "Weather in {c}?",
                      "How is the weather in {c} today?", "what's the weather like in {c}"]).format(c=city)
        temp, cond = r.randint(-10, 40), r.choice(CONDITIONS)
        return ToolTask(t, q, f"The user wants the weather in {city}. I call get_weather.", {p: city},
                        json.dumps({"temperature_c": temp, "condition": cond}),
                        f"The tool says {cond} and {temp}°C.", f"It is {cond} and {temp}°C in {city}.")
    if kind == "time":
        p = r.choice(["city", "location"])
        t = _tool("get_time", "Get the current local time in a city", {p: _str()}, [p])
        q = r.choice(["What time is it in {c}?", "what time is it in {c}", "Current time in {c}?"]).format(c=city)
        hh, mm = r.randint(0, 23), r.randint(0, 59)
        hm = f"{hh:02d}:{mm:02d}"
        return ToolTask(t, q, f"The user wants the time in {city}. I call get_time.", {p: city},
                        json.dumps({"time": hm}), f"The tool says {hm}.", f"It is {hm} in {city}.")
    if kind == "currency":
        t = _tool("convert_currency", "Convert an amount of money between currencies",
                  {"amount": {"type": "number"}, "from": _str("ISO code"), "to": _str("ISO code")},
                  ["amount", "from", "to"])
        amount = r.randint(1, 500)
        src, dst = r.sample(CURRENCIES, 2)
        q = r.choice(["How much is {a} {s} in {d}?", "Convert {a} {s} to {d}.", "{a} {s} in {d}?"]).format(
            a=amount, s=src, d=dst)
        out = round(amount * r.uniform(0.5, 2.0), 1)
        return ToolTask(t, q, f"The user wants to convert {amount} {src} to {dst}. I call convert_currency.",
                        {"amount": amount, "from": src, "to": dst}, json.dumps({"result": out}),
                        f"The tool says {out}.", f"{amount} {src} is {out} {dst}.")
    if kind == "stock":
        t = _tool("get_stock_price", "Get the latest price of a stock", {"symbol": _str("ticker symbol")}, ["symbol"])
        s = r.choice(SYMBOLS)
        q = r.choice(["What is the price of {s}?", "How much is {s} stock?", "Stock price of {s}?"]).format(s=s)
        price = round(r.uniform(10, 900), 2)
        return ToolTask(t, q, f"The user wants the price of {s}. I call get_stock_price.", {"symbol": s},
                        json.dumps({"price": price}), f"The tool says {price}.", f"{s} trades at {price} USD.")
    to = f"{r.choice(NAMES).lower()}@example.com"
    subj = r.choice(WORDS).capitalize()
    t = _tool("send_email", "Send an email", {"to": _str("address"), "subject": _str()}, ["to", "subject"])
    q = r.choice(["Send an email to {t} with subject {s}.", "Email {t} with the subject {s}."]).format(t=to, s=subj)
    return ToolTask(t, q, f"The user wants an email sent to {to}. I call send_email.", {"to": to, "subject": subj},
                    json.dumps({"status": "sent"}), "The tool says the email was sent.", f"Done: the email to {to} was sent.")


TOOL_NAMES = {"weather": "get_weather", "time": "get_time", "currency": "convert_currency",
              "stock": "get_stock_price", "email": "send_email"}
TOOL_KINDS = tuple(TOOL_NAMES)


def _tools_around(r: random.Random, needed: ToolDef | None) -> list[ToolDef]:
    """The declared tools: the needed one (if any) among 0-2 others, in random order."""
    kinds = [k for k in TOOL_KINDS if needed is None or TOOL_NAMES[k] != needed.name]
    tools = [tool_task(r, k).tool for k in r.sample(kinds, r.choice([0, 0, 0, 1, 1, 2]))]
    if needed is not None:
        tools.insert(r.randint(0, len(tools)), needed)
    return tools


# ---- whole conversations ------------------------------------------------------------------------------
def _system(r: random.Random) -> list[ChatMessage]:
    return [ChatMessage(r.choice(["system", "developer"]), r.choice(INSTRUCTIONS))] if r.random() < 0.4 else []


def _history(r: random.Random) -> list[ChatMessage]:
    if r.random() >= 0.15:
        return []
    q, _, a = SIMPLE[r.choice(["greet", "math", "echo", "about"])](r)
    return [ChatMessage("user", q), ChatMessage("assistant", a)]


def _prompt(r: random.Random, msgs: list[ChatMessage], tools: list[ToolDef], date: str) -> ChatPrompt:
    return ChatPrompt(msgs, tools=tools, reasoning_effort=r.choice(EFFORTS), knowledge_cutoff="2024-06",
                      current_date=date)


def random_date(r: random.Random) -> str:
    return f"{r.randint(2025, 2030)}-{r.randint(1, 12):02d}-{r.randint(1, 28 if r.random() < 0.9 else 31):02d}"


TASK_WEIGHTS = {"greet": 0.07, "about": 0.04, "math": 0.20, "echo": 0.24, "json": 0.12, "other": 0.05,
                "tool": 0.14, "tool_res": 0.14}


# The first stage of training: mostly tasks that copy from the conversation (see training.train).
COPY_WEIGHTS = {"echo": 0.5, "json": 0.15, "tool": 0.15, "tool_res": 0.1, "math": 0.1}


def sample_conv(r: random.Random, task: str | None = None, date: str | None = None,
                weights: dict[str, float] | None = None) -> Conv:
    w = weights or TASK_WEIGHTS
    task = task or r.choices(list(w), weights=list(w.values()))[0]
    date = date or random_date(r)
    head = _system(r) + _history(r)
    if task in SIMPLE:
        q, analysis, final = SIMPLE[task](r)
        tools = _tools_around(r, None) if r.random() < 0.15 else []
        return Conv(task, _prompt(r, head + [ChatMessage("user", q)], tools, date),
                    [Part("analysis", analysis), Part("final", final)])
    tt = tool_task(r, r.choice(TOOL_KINDS))
    tools = _tools_around(r, tt.tool)
    args = json.dumps(tt.args, separators=(",", ":"))
    msgs = head + [ChatMessage("user", tt.question)]
    if task == "tool":
        return Conv(task, _prompt(r, msgs, tools, date),
                    [Part("analysis", tt.analysis), Part("commentary", args, f"functions.{tt.tool.name}")])
    call_id = f"call_{r.getrandbits(48):012x}"
    # Chat clients often drop the reasoning when they send the call back; the Responses API keeps it.
    reasoning = tt.analysis if r.random() < 0.5 else None
    msgs += [ChatMessage("assistant", "", reasoning=reasoning, tool_calls=[ToolCall(call_id, tt.tool.name, args)]),
             ChatMessage("tool", tt.result, tool_call_id=call_id)]
    return Conv(task, _prompt(r, msgs, tools, date), [Part("analysis", tt.answer_analysis), Part("final", tt.answer)])
