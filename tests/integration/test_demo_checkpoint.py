"""The committed demo weights expand into a valid HF checkpoint, deterministically, and HF
transformers' GptOssForCausalLM (the reference implementation, MXFP4 dequantised) answers the
README's prompt and a function call greedily with the trained replies. Without the committed file
every test here fails, saying where the file comes from (the demo-train GPU suite)."""

import filecmp
import json

import pytest
import torch

from model.checkpoint_io import write_demo_checkpoint
from model.demo import DEMO_FILE, PRODUCED_BY, UNUSED_ROW, VOCAB_IDS, load_compact
from router.chat_types import ChatMessage, ChatPrompt, ToolDef
from router.harmony import HarmonyFormat
from router.tokenizer import CALL, RETURN

DATE = "2026-12-02"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    if not DEMO_FILE.exists():
        # Not trained yet (the device was not lent when the sweep was to run): reported as a skip with
        # the reason in every run, never passed. Committing the weights turns these tests on.
        pytest.skip(f"{DEMO_FILE.name} is not in the tree yet: the demo model is trained by {PRODUCED_BY}")
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def test_expansion_is_deterministic_and_unused_rows_are_shared(demo, tmp_path):
    again = write_demo_checkpoint(tmp_path / "again")
    files = sorted(p.name for p in demo.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert all(filecmp.cmp(demo / f, again / f, shallow=False) for f in files)
    tensors, meta, cfg = load_compact()
    used = tensors[VOCAB_IDS].long()
    assert meta["steps"] > 0 and len(used) < 5000 and meta["command"].startswith("python")
    from safetensors import safe_open

    index = json.loads((demo / "model.safetensors.index.json").read_text())["weight_map"]
    full = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        with safe_open(str(demo / index[name]), framework="pt") as f:
            full[name] = f.get_tensor(name)
        assert full[name].shape == (201088, cfg.hidden_size)
        assert torch.equal(full[name][used], tensors[name])
    unused = torch.ones(201088, dtype=torch.bool)
    unused[used] = False
    # every untrained token: a zero embedding and the one trained unembedding row (one shared logit)
    assert full["model.embed_tokens.weight"][unused].abs().sum() == 0
    assert torch.equal(full["lm_head.weight"][unused], tensors[UNUSED_ROW].expand(int(unused.sum()), -1))


@pytest.mark.parametrize("messages,tools,want", [
    ([ChatMessage("user", "hi")], [], "<|channel|>final<|message|>Hello! How can I help you today?<|return|>"),
    ([ChatMessage("user", "What is the weather in Paris?")],
     [ToolDef("get_weather", "Get the current weather for a city",
              {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})],
     ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris"}<|call|>'),
])
def test_hf_transformers_greedy_gives_the_trained_answer(demo, hf_factory, messages, tools, want):
    fmt = HarmonyFormat()
    prompt = fmt.render(ChatPrompt(messages, tools=tools, current_date=DATE))
    hf = hf_factory(str(demo))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False, eos_token_id=[RETURN, CALL],
                          pad_token_id=hf.config.pad_token_id)[0, len(prompt):].tolist()
    text = fmt.encoding.decode(out)
    assert text.startswith("<|channel|>analysis<|message|>") and text.endswith(want), text
