"""Structured outputs on the GPU (suite `grammar-gpu`): the bitmask applied in the batched CUDA
sampler next to free rows (the free rows sample exactly as without masks), and constrained answers
from the overlapped loop with CUDA graphs and FlashInfer (full-width 20b layers, random weights, a
few layers): the final channel is entered by the prompt, every answer parses and validates, and a
free row in the same batch runs to its length."""

import json

import jsonschema
import numpy as np
import pytest
import torch

from common.grammar import CALL, END, RETURN, VOCAB_SIZE, GrammarState, JsonGrammar, default_compiler, fill_masks
from common.grammar import schema_json
from engine.sampling import GrammarMasks, SampleRow, Sampler, SamplingParams

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}
FINAL = [200006, 1428, 200008, 3686, 200007, 200006, 173781, 200005, 17196, 200008]  # user "hi", then final


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return torch.device("cuda")


def test_cuda_sampler_masks_only_the_constrained_rows(cuda):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB_SIZE, generator=g).to(cuda)  # [R, V]
    states = [GrammarState(default_compiler(), [JsonGrammar("final", schema_json(SCHEMA))], FINAL) for _ in range(32)]
    bits = np.empty((32, (VOCAB_SIZE + 31) // 32), dtype=np.int32)  # [Rc, W]; 32 rows: llguidance's pool on a big host
    fill_masks(states, bits)
    assert all((bits[i] == bits[0]).all() for i in range(32))
    allowed = set(np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:VOCAB_SIZE]).tolist())
    rows = [SampleRow(f"r{i}", SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0), 100 + i, 9, 0) for i in range(64)]
    masks = GrammarMasks(torch.arange(0, 64, 2, device=cuda), torch.from_numpy(bits).to(cuda))
    out = Sampler(cuda).sample(logits, rows, masks).token_ids.tolist()
    free = Sampler(cuda).sample(logits, rows).token_ids.tolist()
    assert all(out[i] in allowed for i in range(0, 64, 2))
    assert [out[i] for i in range(1, 64, 2)] == [free[i] for i in range(1, 64, 2)]


def test_constrained_answers_in_the_overlapped_loop_with_graphs(cuda):
    from tests.integration.test_async_decode_gpu import make_llm
    from router.tokenizer import load_encoding

    llm = make_llm(True)
    enc = load_encoding()
    g = (JsonGrammar("final", schema_json(SCHEMA)),)
    stop = (RETURN, CALL)
    params = [SamplingParams(max_tokens=32, temperature=t, seed=i, stop_token_ids=stop, grammars=g)
              for i, t in enumerate((0.0, 1.0, 1.0, 0.7))]
    params.append(SamplingParams(max_tokens=24, temperature=1.0, seed=9, ignore_eos=True))
    outs = llm.generate([FINAL] * 5, params)
    for o in outs[:4]:
        assert o.finish_reason.value == "stop" and o.output_ids[-1] in (RETURN, END), enc.decode(o.output_ids)
        jsonschema.validate(json.loads(enc.decode(o.output_ids[:-1])), SCHEMA)
    assert len(outs[4].output_ids) == 24
