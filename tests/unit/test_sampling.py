import pytest
import torch

from common.errors import InvalidRequest
from engine.sampling import SampleRow, Sampler, SamplingParams, _filter_top_k_top_p, exponential_noise


def sampler(eos=()):
    return Sampler(torch.device("cpu"), seed=0, eos_ids=eos)


def rows_of(params: list[SamplingParams], positions=None, seeds=None, generated=0) -> list[SampleRow]:
    return [SampleRow(f"r{i}", p, (seeds[i] if seeds else 1000 + i), (positions[i] if positions else 7), generated)
            for i, p in enumerate(params)]


def test_greedy_and_top_k_1_are_argmax():
    logits = torch.randn(6, 50)
    ps = [SamplingParams(temperature=0 if i % 2 else 1.0, top_k=0 if i % 2 else 1) for i in range(6)]
    assert torch.equal(sampler().sample(logits, rows_of(ps)).token_ids, logits.argmax(-1))


def test_top_p_and_top_k_filter():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    out = _filter_top_k_top_p(probs, torch.tensor([4, 2]), torch.tensor([0.7, 1.0]))
    assert torch.equal(out > 0, torch.tensor([[True, True, False, False], [True, True, False, False]]))
    out = _filter_top_k_top_p(probs, torch.tensor([4, 4]), torch.tensor([1e-6, 1e-6]))
    assert (out > 0).sum(-1).tolist() == [1, 1]  # the top token always survives


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).repeat(4000, 1)
    seeds = list(range(4000))
    ids = sampler().sample(logits, rows_of([SamplingParams(temperature=1.0)] * 4000, seeds=seeds)).token_ids
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03)
    # temperature 0.5 sharpens: p^2 normalised
    ids = sampler().sample(logits, rows_of([SamplingParams(temperature=0.5)] * 4000, seeds=seeds)).token_ids
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.78, 0.195, 0.022, 0.0]), atol=0.03)


def test_noise_is_exponential_and_depends_on_seed_and_position_only():
    q = exponential_noise(torch.tensor([3, 3, 4]), torch.tensor([10, 11, 10]), 50_000)
    assert abs(q[0].mean().item() - 1.0) < 0.02 and abs(q[0].var().item() - 1.0) < 0.05
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    alone = exponential_noise(torch.tensor([4]), torch.tensor([10]), 50_000)
    assert torch.equal(alone[0], q[2])  # the same row in another batch draws the same noise
    # consecutive token ids and consecutive positions are not correlated
    assert abs(torch.corrcoef(torch.stack([q[0], q[1]]))[0, 1].item()) < 0.02


def test_a_near_certain_token_is_sampled_at_every_position_of_a_full_vocabulary():
    """201,088 tokens, one at p ~ 1, the rest at p ~ e^-40 each (1e-12 in all): 400 positions must all
    sample it. With q = -log(u) and u rounding to 1.0, one token in 2^24 drew q = 0 and won: ~1.2 % of
    sampled tokens were arbitrary (the demo model wrote '12 + dringend = 19.' at temperature 1)."""
    v = 201_088
    logits = torch.full((100, v), -40.0)
    logits[:, 1234] = 0.0
    s = sampler()
    for chunk in range(4):
        rows = rows_of([SamplingParams(temperature=1.0)] * 100, positions=[chunk * 100 + i for i in range(100)],
                       seeds=[7] * 100)
        assert (s.sample(logits, rows).token_ids == 1234).all()
    q = exponential_noise(torch.tensor([7] * 64), torch.arange(64), v)
    assert q.min().item() >= 2.0 ** -25 and not torch.isnan(q).any()


def _noise_of(seed: int, position: int, token: int) -> float:
    """The noise of one (seed, position, token), in Python integers: pins the hash's bits."""
    import math

    m64, m32 = (1 << 64) - 1, (1 << 32) - 1
    key = (seed * (-7046029254386353131 & m64) + position * (-4658895280553007687 & m64)) & m64
    key = key - (1 << 64) if key >> 63 else key  # int64
    key = (key ^ (key >> 31)) & m32
    h = (key + token * 0x9E3779B9) & m32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m32
    h ^= h >> 16
    v = float(torch.tensor(((h >> 8) + 0.5) * (1.0 / (1 << 24)), dtype=torch.float32))
    return -math.log1p(-v)


def test_noise_bits_are_the_hash_of_seed_position_and_token():
    seeds, positions = torch.tensor([3, 2**61 + 5, 11]), torch.tensor([10, 0, 4095])
    q = exponential_noise(seeds, positions, 201_088)
    for r in range(3):
        for tok in (0, 1, 31, 200_005, 201_087):
            want = _noise_of(int(seeds[r]), int(positions[r]), tok)
            assert abs(q[r, tok].item() - want) <= 1e-6 * max(1.0, want), (r, tok)


def test_seeded_rows_are_independent_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    ps = [SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i) for i in range(5)]
    full = sampler().sample(logits, rows_of(ps, seeds=[p.seed for p in ps])).token_ids
    for i in range(5):
        one = sampler().sample(logits[i:i + 1], [SampleRow("x", ps[i], ps[i].seed, 7, 0)]).token_ids
        assert one.item() == full[i].item()


def test_penalties_discourage_generated_tokens():
    s = sampler()
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0
    p = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = SampleRow("r", p, 0, 5, 1, output_ids=[3])  # token 3 was generated once already
    assert s.sample(logits, [row]).token_ids.item() != 3
    plain = SamplingParams(temperature=0)
    assert s.sample(logits, [SampleRow("q", plain, 0, 5, 1)]).token_ids.item() == 3
    # presence counts the sampled token too: after one more step it is penalised again
    p2 = SamplingParams(temperature=0, presence_penalty=1.5)
    s2 = sampler()
    first = s2.sample(logits, [SampleRow("z", p2, 0, 5, 0, output_ids=[])]).token_ids.item()
    assert first == 3
    second = s2.sample(logits, [SampleRow("z", p2, 0, 6, 1)]).token_ids.item()
    assert second != 3
    s2.forget("z")  # the slot is reused with fresh counts
    assert s2.sample(logits, [SampleRow("w", p2, 0, 5, 0, output_ids=[])]).token_ids.item() == 3


def test_logit_bias_and_min_tokens_masking():
    logits = torch.zeros(2, 8)
    logits[:, 2] = 5.0
    ps = [SamplingParams(temperature=0, logit_bias=((6, 10.0),)), SamplingParams(temperature=0, min_tokens=3)]
    rows = [SampleRow("a", ps[0], 0, 1, 0), SampleRow("b", ps[1], 0, 1, 0)]
    out = sampler(eos=(2,)).sample(logits, rows).token_ids.tolist()
    assert out[0] == 6 and out[1] != 2  # EOS is masked until min_tokens
    rows[1].num_generated = 3
    assert sampler(eos=(2,)).sample(logits, rows).token_ids.tolist()[1] == 2


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(3, 40)
    ps = [SamplingParams(temperature=0, logprobs=2, frequency_penalty=1.0)] * 3
    out = sampler().sample(logits, rows_of(ps))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.top_logprobs, ref.topk(2, -1).values)


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-1), dict(temperature=3), dict(top_p=0),
                                dict(top_k=-2), dict(logprobs=21), dict(min_tokens=5, max_tokens=2),
                                dict(presence_penalty=3), dict(frequency_penalty=-2.5),
                                dict(logit_bias=((1, 101.0),))])
def test_invalid_params_raise_typed_errors(kw):
    with pytest.raises(InvalidRequest):
        SamplingParams(**kw)
