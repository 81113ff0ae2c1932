"""The fused sampling kernel (kernels/sampling.py) against the torch race of engine.sampling, on the CPU
through the Triton interpreter at small vocabularies: the noise's hash bits are the torch path's exactly,
q agrees to the interpreter's log1p (Goldberg's; CUDA uses libdevice's: tests/kernels/test_sampling_gpu.py),
the chosen tokens are the torch path's but for near ties, -inf never wins, ties go to the lowest index,
and the Sampler with the fused path returns the ids of the torch path on mixed batches."""

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from engine.sampling import (GrammarMasks, SampleRow, Sampler, SamplingParams, _race, exponential_noise,  # noqa: E402
                             noise_hash)
from kernels.sampling import BLOCK, fused_sample, noise_bits  # noqa: E402

SEEDS = torch.tensor([3, 2**61 + 5, 11, -5, 2**63 - 1, 0])  # [R] int64, wrapping products included
POSITIONS = torch.tensor([10, 0, 4095, 7, 2**40, 131_071])


def _near_tie(logits: torch.Tensor, temp: float, q: torch.Tensor, a: int, b: int) -> bool:
    """Tokens a and b score within float32 rounding of each other (float64 l / T - log q)."""
    s = logits.double() / temp - q.double().log()  # [V]
    return abs(s[a] - s[b]).item() <= 1e-5 * max(1.0, abs(s[a]).item())


@pytest.mark.parametrize("vocab", [1000, BLOCK + 1, 3 * BLOCK - 5])
def test_sampling_noise_bits_equal_the_torch_hash(vocab):
    h, q = noise_bits(SEEDS, POSITIONS, vocab)
    assert torch.equal(h, noise_hash(SEEDS, POSITIONS, vocab))  # every bit of every (row, token)
    ref = exponential_noise(SEEDS, POSITIONS, vocab)  # [R, V]
    torch.testing.assert_close(q, ref, rtol=4e-7, atol=0)  # the interpreter's log1p: within ~2 ulp
    assert q.min() > 0 and not q.isnan().any()


def _seed_drawing(h: int) -> int:
    """A seed whose token 0 at position 0 hashes to h: murmur3's finaliser and the row key inverted."""
    m32, m64 = (1 << 32) - 1, (1 << 64) - 1
    h ^= h >> 16
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & m32
    h ^= (h >> 13) ^ (h >> 26)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & m32
    key = h ^ (h >> 16)  # token 0: the key itself
    k = key ^ 1 if key >> 31 else key  # k ^ (k >> 31) == key for this k < 2^32
    seed = (k * pow(-7046029254386353131 & m64, -1, 1 << 64)) & m64
    return seed - (1 << 64) if seed >> 63 else seed


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter's log(0) for v = 1
def test_sampling_noise_extremes_of_v():
    """v's ends: the top hash rounds to v = 1 and draws q = inf (that token loses, as p / inf = 0 does in
    torch); the bottom draws q ~ 2^-25 > 0 (that token wins unless its p is tiny)."""
    top, bottom = _seed_drawing(0xFFFFFFFF), _seed_drawing(0x0000003F)
    seeds, pos = torch.tensor([top, bottom]), torch.zeros(2, dtype=torch.int64)
    h, q = noise_bits(seeds, pos, 100)
    assert h[:, 0].tolist() == [0xFFFFFFFF, 0x3F] == noise_hash(seeds, pos, 100)[:, 0].tolist()
    ref = exponential_noise(seeds, pos, 100)
    assert torch.isinf(q[0, 0]) and torch.isinf(ref[0, 0])
    assert q[1, 0].item() == ref[1, 0].item() == pytest.approx(2.0**-25, rel=1e-6)
    logits = torch.zeros(2, 100)
    logits[0, 0] = 30.0  # p(token 0) ~ 1, but q = inf: it never wins
    ids = fused_sample(logits, torch.ones(2), seeds, pos, torch.ones(2, dtype=torch.bool))
    assert ids[0] != 0 and ids[1] == 0  # q = 2^-25: token 0 wins a flat row
    assert torch.equal(ids, _race(logits, torch.ones(2), seeds, pos, None))


@pytest.mark.parametrize("vocab,splits", [(1000, 1), (4099, 1), (4099, 64)])
def test_sampling_fused_equals_the_torch_race_on_random_rows(vocab, splits):
    g = torch.Generator().manual_seed(vocab + splits)
    r = 12
    logits = torch.randn(r, vocab, generator=g) * torch.linspace(0.5, 6, r)[:, None]  # flat to peaked rows
    temp = torch.tensor([0.3, 0.7, 1.0, 1.5, 2.0, 1.0] * 2)
    seeds = torch.randint(0, 2**62, (r,), generator=g)
    positions = torch.randint(0, 1 << 20, (r,), generator=g)
    noise = torch.ones(r, dtype=torch.bool)
    got = fused_sample(logits, temp, seeds, positions, noise, programs_per_sm=splits)
    want = _race(logits, temp, seeds, positions, None)
    q = exponential_noise(seeds, positions, vocab)
    diff = (got != want).nonzero().flatten().tolist()
    assert len(diff) <= 1, diff  # a near tie is a ~1e-6 event per row
    for i in diff:
        assert _near_tie(logits[i], temp[i].item(), q[i], got[i].item(), want[i].item()), i


def test_sampling_fused_greedy_rows_ties_and_masked_tokens():
    v = 3 * BLOCK + 7
    logits = torch.randn(6, v)
    logits[0, [5, 2 * BLOCK + 1]] = 50.0  # greedy: a tie across tiles -> the lowest index
    logits[1] = float("-inf")  # nothing allowed: 0, as torch.argmax gives
    logits[2] = float("-inf")  # noisy, all masked: 0 too
    logits[3] = float("-inf")
    logits[3, v - 1] = -30.0  # noisy: the only finite token (the tail of the last tile) wins
    logits[4, :] = 40.0  # noisy: every token allowed but the masked ones, which are far ahead elsewhere
    allowed = torch.zeros(v, dtype=torch.bool)
    allowed[[3, BLOCK, 2 * BLOCK + 9, v - 2]] = True
    logits[4, ~allowed] = float("-inf")
    logits[5] = logits[4]
    noise = torch.tensor([False, False, True, True, True, True])
    temp = torch.tensor([1.0, 1.0, 1.0, 0.5, 2.0, 1e-5])
    for pos in range(4):
        ids = fused_sample(logits, temp, torch.arange(6), torch.full((6,), pos), noise, programs_per_sm=3)
        assert ids[:4].tolist() == [5, 0, 0, v - 1]
        assert allowed[ids[4]] and allowed[ids[5]]
    assert logits.argmax(-1)[0].item() == 5


def test_sampling_fused_strided_rows_and_empty_batch():
    wide = torch.randn(3, 1500)
    logits = wide[:, :1200]  # a view into a wider buffer: row stride 1500
    temp, seeds, pos = torch.ones(3), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    noise = torch.tensor([True, False, True])
    got = fused_sample(logits, temp, seeds, pos, noise)
    assert torch.equal(got, fused_sample(logits.contiguous(), temp, seeds, pos, noise))
    assert got[1] == logits[1].argmax()
    assert fused_sample(torch.empty(0, 10), torch.ones(0), seeds[:0], pos[:0], noise[:0]).shape == (0,)


def test_sampling_fused_rows_reproduce_by_seed_and_position_alone():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 2000, generator=g)  # flat rows: the draw decides
    temp, seeds, pos = torch.ones(5), torch.tensor([9, 9, 9, 8, 9]), torch.tensor([1, 2, 3, 1, 1])
    noise = torch.ones(5, dtype=torch.bool)
    full = fused_sample(logits, temp, seeds, pos, noise)
    assert len(set(full[:3].tolist())) == 3  # other positions, other draws
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(fused_sample(logits[perm], temp, seeds[perm], pos[perm], noise)[torch.argsort(perm)], full)
    for i in range(5):
        assert fused_sample(logits[i:i + 1], temp[:1], seeds[i:i + 1], pos[i:i + 1], noise[:1]).item() == full[i]
    # the same logits, seed and position draw the same token; another seed (mostly) another
    same = fused_sample(logits[[0, 0]], temp[:2], torch.tensor([9, 10]), torch.tensor([1, 1]), noise[:2])
    assert same[0] == full[0]


def _rows(ps: list[SamplingParams], step: int) -> list[SampleRow]:
    return [SampleRow(f"r{i}", p, 1000 + i, 30 + step, step, output_ids=[] if p.penalized else None)
            for i, p in enumerate(ps)]


def test_sampling_fused_sampler_returns_the_torch_paths_ids_on_mixed_batches():
    """Greedy, plain stochastic, top-p, top-k, penalised, logit-biased, min_tokens and grammar-masked rows
    in one batch, over a few steps (penalty counts fed by the ids): the fused Sampler == the torch Sampler."""
    v = 2500
    ps = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
          SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.3, top_k=20),
          SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5),
          SamplingParams(temperature=0.9, logit_bias=((7, 5.0), (8, -100.0))),
          SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(11,)),
          SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0)]
    fused, plain = Sampler(torch.device("cpu"), eos_ids=(2,), fused=True), Sampler(torch.device("cpu"), eos_ids=(2,))
    assert fused.fused and not plain.fused
    g = torch.Generator().manual_seed(5)
    bits = np.zeros((1, (v + 31) // 32), dtype=np.int32)  # row 9 may take tokens 0..63 only
    bits[0, :2] = -1
    masks = GrammarMasks(torch.tensor([9]), torch.from_numpy(bits))
    for step in range(4):
        logits = torch.randn(len(ps), v, generator=g) * 3
        logits[:, 2] += 8.0  # EOS likely (min_tokens masks it early)
        a = fused.sample(logits, _rows(ps, step), masks).token_ids
        b = plain.sample(logits, _rows(ps, step), masks).token_ids
        assert torch.equal(a, b), (step, a.tolist(), b.tolist())
        assert a[9] < 64 and a[0] == logits[0].argmax()
    assert fused._rows is not None and fused._rows.filtered is not None
    assert fused._rows.filtered[0].tolist() == [3, 4]  # only the top-p / top-k rows take the sort path


def test_sampling_fused_sampler_all_greedy_and_no_filter_batches():
    logits = torch.randn(4, 1200)
    greedy = [SamplingParams(temperature=0.0)] * 4
    out = Sampler(torch.device("cpu"), fused=True).sample(logits, _rows(greedy, 0)).token_ids
    assert torch.equal(out, logits.argmax(-1))
    hot = [SamplingParams(temperature=1.0)] * 4
    s = Sampler(torch.device("cpu"), fused=True)
    assert torch.equal(s.sample(logits, _rows(hot, 0)).token_ids,
                       Sampler(torch.device("cpu")).sample(logits, _rows(hot, 0)).token_ids)
    assert s._rows is not None and s._rows.filtered is None
