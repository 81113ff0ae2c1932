"""The demo model's training code on the CPU: batches predict exactly the reply tokens, the trainable
model's dense MoE equals the routed computation and padding changes nothing, the structure checker
accepts every expected reply and rejects broken ones, and a few training steps write a compact file
the checkpoint writer expands and the engine loads."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model.config import preset
from router.harmony import HarmonyFormat
from router.tokenizer import CALL, RETURN
from training.data import Example, make_examples, pack
from training.evaluate import UNUSED, check, probes
from training.model import DemoModel
from training.train import Batches, RepeatBatches


@pytest.fixture(scope="module")
def fmt():
    return HarmonyFormat()


@pytest.fixture(scope="module")
def examples(fmt):
    return make_examples(fmt, 3, 60)


def _remap(examples: list[Example]) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = torch.tensor(sorted({t for e in examples for t in e.prompt + e.reply}))
    remap = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.numel())
    return vocab, remap


def test_batches_predict_exactly_the_reply_tokens(examples):
    vocab, remap = _remap(examples)
    b = Batches(pack(examples), remap, 1500, torch.device("cpu"), random.Random(0))
    seen = []
    for _ in range(len(b)):
        ids, pad, sel, tgt = b.next()
        flat_ids = ids.reshape(-1)
        for row in range(ids.shape[0]):
            n = int((~pad[row]).sum())
            toks = vocab[torch.cat([ids[row, :n], tgt[(sel // ids.shape[1]) == row][-1:]])].tolist()
            rows_sel = sel[(sel // ids.shape[1]) == row]
            e = next(e for e in examples if e.prompt + e.reply == toks)
            assert len(rows_sel) == len(e.reply)
            assert vocab[tgt[(sel // ids.shape[1]) == row]].tolist() == e.reply
            assert vocab[flat_ids[rows_sel]].tolist() == (e.prompt + e.reply)[len(e.prompt) - 1:-1]
            seen.append(id(e))
    assert len(set(seen)) == len(examples)  # one epoch covers every conversation once


def test_repeat_batches_target_the_copy():
    rb = RepeatBatches(torch.arange(10, 50), 256, torch.device("cpu"), 0)
    ids, pad, sel, tgt = rb.next()
    assert not pad.any() and torch.equal(ids.reshape(-1)[sel + 1], tgt)
    half = ids.shape[1] // 2
    assert torch.equal(ids[:, :half], ids[:, half:])


def test_dense_moe_equals_routed_experts_and_padding_is_invisible():
    from kernels.reference import swiglu

    cfg = preset("tiny-demo")
    m = DemoModel(cfg, 300, 0)
    layer = m.layers[0]
    x = torch.randn(2, 9, cfg.hidden_size)
    flat = x.reshape(-1, cfg.hidden_size)
    vals, ids = torch.topk(torch.nn.functional.linear(flat, layer.router_w, layer.router_b), cfg.num_experts_per_tok)
    gate = torch.softmax(vals, -1)
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for k in range(cfg.num_experts_per_tok):
            e = int(ids[t, k])
            act = swiglu(flat[t] @ layer.w1[e].T + layer.b1[e], cfg.swiglu_alpha, cfg.swiglu_limit)
            ref[t] += gate[t, k] * (act @ layer.w2[e].T + layer.b2[e])
    torch.testing.assert_close(layer._moe(x, False).reshape(-1, cfg.hidden_size), ref, rtol=1e-5, atol=1e-5)
    tok = torch.randint(0, 300, (1, 40))
    left = torch.cat([torch.zeros(1, 7, dtype=torch.long), tok], 1)
    pad = torch.zeros(1, 47, dtype=torch.bool)
    pad[0, :7] = True
    with torch.no_grad():
        torch.testing.assert_close(m(left, pad, True)[:, 7:], m(tok, torch.zeros(1, 40, dtype=torch.bool), True),
                                   rtol=1e-4, atol=1e-4)


def test_structure_check(fmt, examples):
    for e in examples + probes(fmt, "2026-12-02"):
        assert check(fmt, e, e.reply) == (True, True), fmt.encoding.decode(e.reply)
    call = next(e for e in examples if e.reply[-1] == CALL)
    final = next(e for e in examples if e.reply[-1] == RETURN)
    assert check(fmt, final, final.reply[:-1]) == (False, False)  # no stop token
    assert check(fmt, final, final.reply[:-1] + [UNUSED]) == (False, False)
    text = fmt.encoding.decode(call.reply)
    for bad in (text.replace("functions.", "functions.no_such_"), text.replace("<|message|>{", "<|message|>[")):
        assert check(fmt, call, fmt.encoding.encode(bad, allowed_special="all"))[0] is False
    # a valid call of another declared function still has the structure, just not the exact answer
    name = call.tools[0][0]
    args = {p: "x" for p in call.tools[0][2]}
    other = text[:text.index("to=functions.")] + f"to=functions.{name}<|channel|>commentary <|constrain|>json" \
        f"<|message|>{json.dumps(args)}<|call|>"
    assert check(fmt, call, fmt.encoding.encode(other, allowed_special="all"))[0] is True


def test_a_few_steps_write_a_file_the_engine_serves(tmp_path):
    from model.checkpoint_io import write_demo_checkpoint
    from model.demo import load_compact
    from training.evaluate import engine_outputs
    from training.train import main

    out, res = tmp_path / "demo.safetensors", tmp_path / "run.json"
    assert main(["--device", "cpu", "--steps", "4", "--examples", "300", "--copy-examples", "100",
                 "--eval-per-task", "1", "--sampled-per-task", "1", "--tokens-per-batch", "1500", "--repeat-tokens",
                 "256", "--warmup", "2", "--max-new", "6", "--layers", "2", "--out", str(out), "--result", str(res)]) == 0
    rec = json.loads(res.read_text())
    assert rec["steps"] == 4 and set(rec["eval"]["greedy"]) >= {"tool", "echo", "all"} and "hi" in rec["eval"]["probes"]
    tensors, meta, cfg = load_compact(out)
    assert cfg.num_hidden_layers == 2 and meta["command"].startswith("python") and "--layers 2" in meta["command"]
    ckpt = write_demo_checkpoint(tmp_path / "ckpt", out)
    assert (ckpt / "config.json").exists()
    fmt = HarmonyFormat()
    assert len(engine_outputs(out, probes(fmt, "2026-12-02")[:1], max_new=3)[0]) == 3


def test_probes_are_what_the_router_renders_for_the_tests_requests(fmt):
    """The sweep picks its winner partly on training.evaluate.probes: they must be the very prompt ids the
    integration tests' requests become (chat completions through router.openai_models)."""
    from router.openai_models import ChatCompletionRequest, to_chat_prompt

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = {"id": "call_0123456789ab", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    requests = {
        "hi": {"messages": [{"role": "user", "content": "hi"}]},
        "math": {"messages": [{"role": "user", "content": "What is 12+7?"}]},
        "call-paris": {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [weather]},
        "result-paris": {"tools": [weather], "messages": [
            {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call],
             "reasoning_content": "The user wants the weather in Paris. I call get_weather."},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 21, "condition": "clear"})}]},
    }
    by_name = {e.task[len("probe-"):]: e for e in probes(fmt, "2026-12-02")}
    for name, body in requests.items():
        req = ChatCompletionRequest.model_validate({"model": "gpt-oss-tiny", **body})
        assert fmt.render(to_chat_prompt(req, "2026-12-02", "2024-06")) == by_name[name].prompt, name
