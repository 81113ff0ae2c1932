import pytest
import torch

from common.errors import InvalidRequest
from engine.sampling import Sampler, SamplingParams, _filter_top_k_top_p


def sampler():
    return Sampler(torch.device("cpu"), seed=0)


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(6, 50)
    rows = [(f"r{i}", SamplingParams(temperature=0 if i % 2 else 1.0, top_k=0 if i % 2 else 1)) for i in range(6)]
    assert torch.equal(sampler()(logits, rows).token_ids, logits.argmax(-1))


def test_top_p_and_top_k_filter():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    out = _filter_top_k_top_p(probs, torch.tensor([4, 2]), torch.tensor([0.7, 1.0]))
    assert torch.equal(out > 0, torch.tensor([[True, True, False, False], [True, True, False, False]]))
    out = _filter_top_k_top_p(probs, torch.tensor([4, 4]), torch.tensor([1e-6, 1e-6]))
    assert (out > 0).sum(-1).tolist() == [1, 1]  # the top token always survives


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).repeat(4000, 1)
    rows = [(f"r{i}", SamplingParams(temperature=1.0)) for i in range(4000)]
    ids = sampler()(logits, rows).token_ids
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03)
    # temperature 0.5 sharpens: p^2 normalised
    rows = [(f"r{i}", SamplingParams(temperature=0.5)) for i in range(4000)]
    freq = torch.bincount(sampler()(logits, rows).token_ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.78, 0.195, 0.022, 0.0]), atol=0.03)


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(temperature=3), dict(top_p=0),
                                dict(top_k=-2), dict(logprobs=21), dict(min_tokens=5, max_tokens=2)])
def test_invalid_params_raise_typed_errors(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)
