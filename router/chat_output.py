"""OpenAI response bodies and SSE chunks for chat and text completions, from the handlers' events.

Every function takes the merged events of a request's choices, `(choice index, event)` (router/
fanout.py; n = 1 is one choice), so n > 1 and n = 1 go through the same code: a non-streamed body
has one choice per index, a stream's chunks carry their choice's index. Usage counts the prompt
once per prompt (OpenAI's convention) and the completion tokens of every choice.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator

from common.errors import TandemError
from router.chat_types import DeltaKind
from router.errors import error_code
from router.handlers import Event
from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.orchestrator import Job


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def error_event(e: TandemError) -> bytes:
    return sse({"error": {"message": e.message, "type": e.error_type, "param": e.param, "code": error_code(e)}})


def abort_tail(head: dict, choice: dict, e: TandemError) -> list[bytes]:
    """How a stream ends when the server ends it (timeout, drain): finish_reason abort, the reason, [DONE]."""
    return [sse({**head, "choices": [{"index": 0, **choice, "finish_reason": "abort"}]}), error_event(e),
            b"data: [DONE]\n\n"]


def reasoning_fields(text: str | None) -> dict:
    """The chain of thought under both names clients read: `reasoning` (OpenAI's guidance for gpt-oss on Chat
    Completions, OpenRouter, vLLM since it dropped the other; Codex reads it) and `reasoning_content` (the
    DeepSeek spelling that LangChain, LlamaIndex and many UIs still read)."""
    return {"reasoning": text, "reasoning_content": text}


def delta_json(ev: Event) -> list[dict]:
    """OpenAI chat deltas of one event: reasoning, content and tool-call pieces, in order."""
    out = []
    for d in ev.deltas:
        if d.kind == DeltaKind.REASONING:
            out.append(reasoning_fields(d.text))
        elif d.kind == DeltaKind.CONTENT:
            out.append({"content": d.text})
        elif d.kind == DeltaKind.TOOL_CALL_START:
            out.append({"tool_calls": [{"index": d.tool_index, "id": d.tool_call_id, "type": "function",
                                        "function": {"name": d.tool_name, "arguments": ""}}]})
        elif d.kind == DeltaKind.TOOL_CALL_ARGS:
            out.append({"tool_calls": [{"index": d.tool_index, "function": {"arguments": d.text}}]})
    return out


def prefix_usage(jobs: list) -> dict:
    """usage.prompt_tokens_details.cached_tokens as OpenAI and vLLM report it (prompt tokens not
    recomputed), and tandem's own breakdown: computed tokens, KV bytes shipped, where it prefilled."""
    st = [j.stats for j in jobs]
    return {"prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in st)},
            "tandem": {"computed_tokens": sum(s.computed_tokens for s in st),
                       "decode_cached_tokens": sum(s.decode_cached_tokens for s in st),
                       "kv_bytes_shipped": sum(s.kv_bytes for s in st), "prefill": st[0].prefill if st else ""}}


def _usage(jobs: list[Job], n_out: int, prompts: int = 1) -> dict:
    n_in = sum(len(j.prompt_ids) for j in jobs[::max(len(jobs) // prompts, 1)])
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out, **prefix_usage(jobs)}


# ---- chat ------------------------------------------------------------------------------------------
async def collect_chat(events, base: dict, req: ChatCompletionRequest, jobs: list[Job]) -> dict:
    ids: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    logprobs: dict[int, list[dict]] = {i: [] for i in range(len(jobs))}
    parsed: dict = {}
    async for i, (ev, p) in events:
        ids[i] += ev.token_ids
        logprobs[i] += ev.logprobs
        if p is not None:
            parsed[i] = p
    choices = []
    for i in range(len(jobs)):
        p = parsed[i]
        msg: dict = {"role": "assistant", "content": p.content, **reasoning_fields(p.reasoning)}
        if p.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in p.tool_calls]
        choice = {"index": i, "message": msg, "finish_reason": p.finish_reason,
                  "logprobs": {"content": logprobs[i]} if req.logprobs else None}
        if req.return_token_ids:
            choice["token_ids"] = ids[i]
        choices.append(choice)
    usage = _usage(jobs, sum(len(x) for x in ids.values()))
    return {**base, "object": "chat.completion", "choices": choices, "usage": usage}


async def chat_sse(events, base: dict, req: ChatCompletionRequest, jobs: list[Job]) -> AsyncIterator[bytes]:
    head = {**base, "object": "chat.completion.chunk"}
    n_out = 0
    try:
        for i in range(len(jobs)):
            yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]})
        async for i, (ev, parsed) in events:
            n_out += len(ev.token_ids)
            choices = [{"index": i, "delta": piece, "finish_reason": None} for piece in delta_json(ev)]
            if not choices and (ev.logprobs or (req.return_token_ids and ev.token_ids)):
                choices = [{"index": i, "delta": {}, "finish_reason": None}]
            if choices:  # logprobs and token ids of the event ride on its first chunk
                if req.logprobs and ev.logprobs:
                    choices[0]["logprobs"] = {"content": ev.logprobs}
                if req.return_token_ids:
                    choices[0]["token_ids"] = ev.token_ids
            for c in choices:
                yield sse({**head, "choices": [c]})
            if parsed is not None:
                yield sse({**head, "choices": [{"index": i, "delta": {}, "finish_reason": parsed.finish_reason}]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(jobs, n_out)})
    except TandemError as e:
        yield error_event(e)
    yield b"data: [DONE]\n\n"


# ---- completions -----------------------------------------------------------------------------------
def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy logprobs object; an echoed prompt's first token has null logprob and top_logprobs. text_offset:
    where each token's text starts in the choice's text (the tokens' texts laid end to end from `offset`, the
    length already streamed)."""
    starts = list(itertools.accumulate((len(e["token"]) for e in entries[:-1]), initial=offset)) if entries else []
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries], "text_offset": starts}


async def collect_completions(h, rid: str, groups: list, jobs: list[Job], req: CompletionRequest, created: int) -> dict:
    """`groups`: per prompt, the merged events of its n choices; choice index = prompt * n + choice."""
    n = req.n
    choices: list[dict] = []
    n_out = 0
    for k, events in enumerate(groups):
        acc = {i: ("", [], [], "stop") for i in range(n)}
        prompt_lps: dict[int, list[dict]] = {}
        async for i, ev in events:
            text, ids, lps, finish = acc[i]
            acc[i] = (text + ev.text, ids + ev.token_ids, lps + ev.logprobs, ev.finish_reason or finish)
            if ev.prompt_logprobs is not None:
                prompt_lps[i] = ev.prompt_logprobs
        for i in range(n):
            job = jobs[k * n + i]
            text, ids, lps, finish = acc[i]
            if req.echo:
                text = h.tok.decode(job.prompt_ids, skip_special=req.skip_special_tokens) + text
                lps = prompt_lps.get(i, []) + lps
            choice = {"index": k * n + i, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(lps) if req.logprobs is not None else None}
            if req.return_token_ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = job.prompt_ids
            choices.append(choice)
            n_out += len(ids)
    return {"id": rid, "object": "text_completion", "created": created,
            "model": req.model, "choices": choices, "usage": _usage(jobs, n_out, len(groups))}


async def completion_sse(h, jobs: list[Job], events, base: dict, req: CompletionRequest) -> AsyncIterator[bytes]:
    n_out = 0
    try:
        if req.echo and req.logprobs is None:
            for i, job in enumerate(jobs):
                yield sse({**base, "choices": [{"index": i, "text": h.tok.decode(job.prompt_ids), "finish_reason": None,
                                                "logprobs": None}]})
        offsets = [0] * len(jobs)  # per choice: the length of the logprob tokens' texts streamed so far
        async for i, ev in events:
            if ev.prompt_logprobs is not None:  # echo + logprobs: the prompt comes with its first token's event
                echo = {"index": i, "text": h.tok.decode(jobs[i].prompt_ids), "finish_reason": None,
                        "logprobs": completion_logprobs(ev.prompt_logprobs)}
                offsets[i] = sum(len(e["token"]) for e in ev.prompt_logprobs)
                yield sse({**base, "choices": [echo]})
            n_out += len(ev.token_ids)
            if ev.text or ev.token_ids or ev.finish_reason:
                choice = {"index": i, "text": ev.text, "finish_reason": ev.finish_reason,
                          "logprobs": completion_logprobs(ev.logprobs, offsets[i]) if req.logprobs is not None else None}
                offsets[i] += sum(len(e["token"]) for e in ev.logprobs)
                if req.return_token_ids:
                    choice["token_ids"] = ev.token_ids
                yield sse({**base, "choices": [choice]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**base, "choices": [], "usage": _usage(jobs, n_out)})
    except TandemError as e:
        yield error_event(e)
    yield b"data: [DONE]\n\n"
