"""The overlapped step loop on the GPU with CUDA graphs and FlashInfer (full-width gpt-oss-20b layers,
random weights, a few layers): the same greedy tokens as the synchronous loop, no host sync while a
decode step is launched, seeded sampling reproducible. Run through the device tool (suite `served`)."""

import pytest
import torch

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.gpu

LAYERS = 4


def make_llm(overlap: bool) -> LLM:
    cfg = EngineConfig(random_preset="gpt-oss-20b", random_layers=LAYERS, device="cuda", dtype="bfloat16", fp8=True,
                       fp8_attention=False, attention_backend="flashinfer", linear_backend="scaled_mm",
                       moe_backend="triton", kv_cache_bytes=4 << 30, async_decode=overlap,
                       # no prefix cache: a repeated prompt would hit it, and a first token computed from
                       # cached KV differs from a full prefill by bf16 noise (enough to flip a sampled token)
                       enable_prefix_caching=False,
                       # decode CUDA graphs captured by the offline engine (buckets 1, 2, 4, 8: up to max_num_seqs)
                       cuda_graphs=True,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096))
    llm = LLM(cfg)
    assert sorted(llm.engine.runner.graphs.graphs) == [1, 2, 4, 8]
    return llm


@pytest.fixture(scope="module")
def pair():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return make_llm(True), make_llm(False)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100_000, (n,), generator=g).tolist() for n in lengths]


def test_async_decode_gpu_greedy_equals_sync(pair):
    """Both orders of the overlapped loop (engine.core.collect_ready): steps collected after the next
    launch, and steps the GPU finished before the host planned the next, collected first (counted: the
    order must actually occur). Which order a step takes is timing: on these small steps it was 0-4 of
    23 (prefix-gpu-tests runs), so every third check first waits for the GPU, forcing the second order."""
    fast, slow = pair
    ps = prompts([5, 40, 130, 300, 17, 999])
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    runner, seen = fast.engine.runner, []
    ready = runner.ready

    def checked(h):
        if len(seen) % 3 == 2:
            torch.cuda.synchronize()  # the host is late: the step in flight is done
        seen.append(r := ready(h))
        return r

    runner.ready = checked
    try:
        a = [o.output_ids for o in fast.generate(ps, params)]
    finally:
        runner.ready = ready
    b = [o.output_ids for o in slow.generate(ps, params)]
    assert a == b
    print(f"collected first: {sum(seen)} of {len(seen)} steps in flight")
    assert any(seen)
    fast.engine.core.collect_ready = False  # launch first, always
    try:
        assert [o.output_ids for o in fast.generate(ps, params)] == b
    finally:
        fast.engine.core.collect_ready = True
    waits = []
    wait_ready = runner.wait_ready
    runner.wait_ready = lambda h, t: (waits.append(r := wait_ready(h, t)), r)[1]
    runner.ready = lambda h: False  # every step reads as running: each first-token step takes the bounded wait
    fast.engine.core.first_token_wait_s = 0.003  # --first-token-wait-ms 3: steps with first tokens waited for
    try:
        assert [o.output_ids for o in fast.generate(ps, params)] == b
    finally:
        fast.engine.core.first_token_wait_s = 0.0
        runner.wait_ready = wait_ready
        runner.ready = ready
    print(f"first-token steps waited for: {sum(waits)} of {len(waits)} ready within 3 ms")
    assert waits
    for llm in pair:
        assert llm.kv.num_free() == tuple(n - 1 for n in llm.kv.spec.num_pages)  # only the graphs' padding page


def test_async_decode_gpu_launch_does_not_sync(pair):
    fast, _ = pair
    eng = fast.engine
    for p in prompts([64, 200, 33]):
        eng.add_request(p, SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True))
    for _ in range(3):  # prefills and the first decode steps (eager, plans, captures nothing new)
        eng.step()
    launch = eng.runner.launch

    def strict(*args, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    eng.runner.launch = strict
    try:
        for _ in range(10):  # decode steps: graph replay, sampling with top-p and seeds, D2H copies
            eng.step()
    finally:
        eng.runner.launch = launch
    while eng.has_unfinished():
        eng.step()


def test_async_decode_gpu_seeded_sampling_reproducible(pair):
    fast, slow = pair
    ps = prompts([12, 70, 5], seed=1)
    sp = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=40 + i) for i in range(3)]
    first = [o.output_ids for o in fast.generate(ps, sp)]
    again = [o.output_ids for o in fast.generate(ps, sp)]
    assert first == again
    sync = [o.output_ids for o in slow.generate(ps, sp)]
    assert sync == first  # the same noise for the same (seed, position) in either loop
