"""The fused sampling kernel (kernels/sampling.py) on the GPU at gpt-oss's vocabulary (V = 201,088): the first
step of suite `sampling-gpu`, so a wrong kernel fails before the micro-benchmark times it.

  * the noise: hash bits == engine.sampling.noise_hash's on CUDA, q within 1 ulp of exponential_noise's
    (libdevice's log1pf against torch's; the fraction bit-identical is printed, and benchmarks/sampling.py
    records it);
  * the tokens: fused_sample == the torch race (softmax(l / T) / q).argmax() at batch 1 / 64 / 256, but for
    near ties of p / q (checked in float64); greedy rows == argmax;
  * the Sampler (fused by default on CUDA) == Sampler(fused=False) on a mixed batch of 64 (greedy, top-p,
    top-k, penalties, grammar masks) over a few steps, with no host sync once its row tensors are cached;
  * fused_sample captured in a CUDA graph replays with new positions as the eager call does.

Run alone (CPU kernel tests set TRITON_INTERPRET=1 at import):
    python -m pytest -q -rP -m gpu tests/kernels/test_sampling_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_alone import GPU_ALONE
from tests.support.cuda_graph import capture

pytestmark = GPU_ALONE

DEV = "cuda"
V = 201_088


def _case(r: int, seed: int) -> tuple[torch.Tensor, ...]:
    """logits [R, V] (LLM-like spread: a few tokens far ahead), temp [R], seeds [R], positions [R]."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(r, V, device=DEV, generator=g) * 2.0
    logits[:, :64] += 6.0 * torch.rand(r, 64, device=DEV, generator=g)
    temp = torch.tensor([0.5, 0.8, 1.0, 1.0, 1.3, 2.0], device=DEV).repeat(r // 6 + 1)[:r]
    seeds = torch.randint(0, 2**62, (r,), device=DEV, generator=g)
    positions = torch.randint(0, 1 << 17, (r,), device=DEV, generator=g)
    return logits, temp, seeds, positions


def test_noise_bits_equal_the_torch_path_on_cuda():
    from engine.sampling import exponential_noise, noise_hash
    from kernels.sampling import noise_bits

    _, _, seeds, positions = _case(64, 1)
    h, q = noise_bits(seeds, positions, V)
    assert torch.equal(h, noise_hash(seeds, positions, V))  # every bit of 64 x 201,088 draws
    ref = exponential_noise(seeds, positions, V)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(q), ~fin)
    ulps = (q[fin].view(torch.int32) - ref[fin].view(torch.int32)).abs()  # q > 0: the bit patterns are ordered
    exact = (ulps == 0).float().mean().item()
    print(f"q bit-identical to torch's: {exact:.6%} (max {ulps.max().item()} ulp)")
    assert ulps.max().item() <= 1


def _near_tie(logits, temp, q, a, b) -> bool:
    s = logits.double() / temp - q.double().log()  # [V]
    return abs(s[a] - s[b]).item() <= 1e-5 * max(1.0, abs(s[a]).item())


@pytest.mark.parametrize("r", [1, 64, 256])
def test_fused_tokens_equal_the_torch_race(r):
    from engine.sampling import _race, exponential_noise
    from kernels.sampling import fused_sample

    logits, temp, seeds, positions = _case(r, r)
    noise = torch.ones(r, dtype=torch.bool, device=DEV)
    noise[::5] = False  # greedy rows in the same launch
    got = fused_sample(logits, temp, seeds, positions, noise)
    want = torch.where(noise, _race(logits, temp, seeds, positions, None), logits.argmax(-1))
    diff = (got != want).nonzero().flatten().tolist()
    print(f"R={r}: {r - len(diff)}/{r} tokens equal")
    assert len(diff) <= max(1, r // 64), diff
    q = exponential_noise(seeds, positions, V)
    for i in diff:
        assert noise[i] and _near_tie(logits[i], temp[i].item(), q[i], got[i].item(), want[i].item()), i
    if r > 1:
        assert len(set(got[noise].tolist())) > 1  # draws, not one argmax


def _masks(rows: range):
    """Grammar masks for `rows`: tokens 0..1023 allowed."""
    import numpy as np

    from engine.sampling import GrammarMasks

    bits = np.zeros((len(rows), (V + 31) // 32), dtype=np.int32)  # [Rc, W]
    bits[:, :32] = -1
    return GrammarMasks(torch.tensor(list(rows), device=DEV), torch.from_numpy(bits).to(DEV))


def test_sampler_fused_equals_the_torch_sampler():
    from engine.sampling import SampleRow, Sampler, SamplingParams

    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
             SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=40),
             SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5),
             SamplingParams(temperature=1.0, min_tokens=4, logit_bias=((17, 3.0),))]
    ps = [kinds[i % len(kinds)] for i in range(64)]
    fused = Sampler(torch.device(DEV), eos_ids=(200002,))
    plain = Sampler(torch.device(DEV), eos_ids=(200002,), fused=False)
    assert fused.fused and not plain.fused
    masks = _masks(range(3, 64, 8))

    def rows(step):
        return [SampleRow(f"r{i}", p, 77 + i, 500 + step, step, output_ids=[] if p.penalized else None)
                for i, p in enumerate(ps)]

    for step in range(4):
        logits, _, _, _ = _case(64, 100 + step)
        a = fused.sample(logits, rows(step), masks).token_ids
        b = plain.sample(logits, rows(step), masks).token_ids
        assert torch.equal(a, b), (step, (a != b).nonzero().flatten().tolist())
        assert (a[3::8] < 1024).all()


def test_fused_sampler_step_does_not_sync():
    """The overlapped loop's sampler step (engine/runner.py): greedy, stochastic, top-p and grammar rows,
    row tensors cached after the first step, nothing waits for the GPU."""
    from engine.sampling import SampleRow, Sampler, SamplingParams

    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=1.0, top_p=0.9)]
    ps = [kinds[i % 3] for i in range(64)]
    s = Sampler(torch.device(DEV))
    logits, _, _, _ = _case(64, 5)
    masks = _masks(range(0, 64, 4))
    for step in range(3):
        rows = [SampleRow(f"r{i}", p, 9 + i, 100 + step, step) for i, p in enumerate(ps)]
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            ids = s.sample(logits, rows, masks).token_ids
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert (ids[::4] < 1024).all()


def test_fused_sample_replays_in_a_cuda_graph():
    from kernels.sampling import fused_sample

    logits, temp, seeds, positions = _case(64, 7)
    noise = torch.ones(64, dtype=torch.bool, device=DEV)
    g, out = capture(lambda: fused_sample(logits, temp, seeds, positions, noise))  # compiled before capture
    for step in range(3):
        positions.add_(1)
        g.replay()
        assert torch.equal(out, fused_sample(logits, temp, seeds, positions, noise)), step
