"""Tensor / expert parallelism inside the layers, on CPU with gloo: world 2 and 4 give the logits of
TP1 (fp32 tolerance) and the same greedy tokens, for experts sliced by TP and whole experts per rank
(EP with the TP all-reduce as combine)."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.errors import ConfigError
from kernels.registry import make_backends
from launcher import ports
from model.config import preset
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache
from model.loader import load_weights
from model.parallel import MoEMode, ParallelConfig
from model.weights import SafetensorsSource


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range: a spawned process binds it later


def _run(model: GptOss, ids: list[int], decode_steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill `ids` through the paged cache, then greedy-decode; returns (prefill logits, tokens)."""
    spec = plan_kv_cache(model.cfg, 4 << 20, page_size=4, max_num_seqs=2, tp_size=model.par.tp_size,
                         dtype=torch.float32)
    pool, kv, pages = KVPool(spec), KVManager(spec), SeqPages()
    kv.grow(pages, len(ids))
    logits = model.compute_logits(model(torch.tensor(ids), build_step_meta([SeqStep(pages, 0, len(ids))], spec), pool))
    toks = [int(logits[-1].argmax())]
    for _ in range(decode_steps):
        pos = len(ids) + len(toks) - 1
        kv.grow(pages, pos + 1)
        h = model(torch.tensor(toks[-1:]), build_step_meta([SeqStep(pages, pos, 1)], spec), pool)
        toks.append(int(model.compute_logits(h)[-1].argmax()))
    return logits, toks


def _worker(rank: int, world: int, port: int, path: str, mode: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        src = SafetensorsSource(path)
        moe, _, vocab = mode.partition("+")
        par = ParallelConfig(world, rank, MoEMode(moe), dist.group.WORLD, vocab_parallel=vocab == "vocab")
        m = GptOss(src.config, make_backends(), dtype=torch.float32, parallel=par)
        load_weights(m, src, progress=False)
        ids = list(range(5, 5 + 3 * src.config.sliding_window + 2))
        logits, toks = _run(m, ids, 12)
        if rank == 0:
            out["logits"], out["toks"] = logits, toks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,mode", [(2, "tp"), (2, "ep"), (4, "tp"), (4, "ep"), (2, "ep+vocab"), (4, "tp+vocab")])
def test_tp_and_ep_match_tp1(world, mode, ckpt_factory):
    path = ckpt_factory("tiny-c")  # 16 q / 8 KV heads, 8 experts, I = 128: divisible by 2 and 4
    ref_model = GptOss(SafetensorsSource(path).config, make_backends(), dtype=torch.float32)
    load_weights(ref_model, SafetensorsSource(path), progress=False)
    ids = list(range(5, 5 + 3 * ref_model.cfg.sliding_window + 2))
    ref_logits, ref_toks = _run(ref_model, ids, 12)
    with mp.Manager() as mgr:
        out = mgr.dict()
        mp.spawn(_worker, args=(world, _free_port(), path, mode, out), nprocs=world, join=True)
        logits, toks = out["logits"], out["toks"]
    assert ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item() < 1e-5
    assert toks == ref_toks


def test_expert_count_not_divisible_is_refused():
    cfg = dataclasses.replace(preset("tiny-c"), num_local_experts=6)
    with pytest.raises(ConfigError, match="expert count"):
        ParallelConfig(4, 0, MoEMode.EP).validate(cfg)
    ParallelConfig(2, 0, MoEMode.EP).validate(cfg)  # 6 experts over 2 ranks is fine
    with pytest.raises(ConfigError, match="vocab"):
        ParallelConfig(4, 0, MoEMode.TP, vocab_parallel=True).validate(dataclasses.replace(cfg, vocab_size=1030))
    cfg = preset("tiny-b")
    with pytest.raises(ConfigError, match="KV heads"):
        ParallelConfig(2, 0, MoEMode.TP).validate(cfg)  # tiny-b has a single KV head
