"""Steps of one loaded model under several fusion settings (kernels.registry.Fusion), each setting with its own KV
pool over one sequence's pages: how the fusion tests compare settings step by step, on the CPU and on a GPU."""

from __future__ import annotations

import torch


def steps_by_setting(model, settings: list[str], lens: tuple[int, ...], device: str = "cpu", *, page_size: int = 16,
                     same_kv: bool = False, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """For each step length in `lens` (one sequence, positions running on), the model's hidden states per setting.
    same_kv: every setting's step starts from the first setting's KV, so each step is judged alone (a setting whose
    outputs differ would otherwise carry its difference into the next step's KV)."""
    from kernels.registry import parse_fusions
    from model.context import SeqStep, build_step_meta
    from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache

    spec = plan_kv_cache(model.cfg, 1 << 30 if device != "cpu" else 1 << 20, page_size=page_size, max_num_seqs=2,
                         dtype=model.dtype)
    mgr, pages = KVManager(spec), SeqPages()
    pools = {s: KVPool(spec, device) for s in settings}
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lens),), device=device,
                        generator=torch.Generator(device).manual_seed(seed))
    pos, outs = 0, []
    for n in lens:
        mgr.grow(pages, pos + n)
        meta = build_step_meta([SeqStep(pages, pos, n)], spec, device)
        if same_kv:
            for s in settings[1:]:
                for a, b in zip(pools[s].pools, pools[settings[0]].pools):
                    a.copy_(b)
        out = {}
        for s in settings:
            model.backends.fusions = parse_fusions(s)
            out[s] = model(ids[pos:pos + n], meta, pools[s])
        outs.append(out)
        pos += n
    return outs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def graph_decode_decodes_every_token(cfg) -> None:
    """The engine's CUDA-graph decode under EngineConfig `cfg` (cuda_graphs set here): two prompts (700 and 1 tokens)
    each decode 12 greedy tokens."""
    import dataclasses

    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(dataclasses.replace(cfg, cuda_graphs=True))  # captures its decode graphs
    assert llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 100_000, (n,), generator=g).tolist() for n in (700, 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert all(len(o.output_ids) == 12 for o in outs)
