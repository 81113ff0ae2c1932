"""Worker and `tandem generate` flags through their parsers into what they configure: --collect-order
(engine/worker_args.py) reaches the decode worker's step loop (decode_worker.main.tune_loop ->
EngineCore.collect_ready, and with it whether a finished step is collected before the next launch);
--dtype reaches the EngineConfig and the built model's weights and KV pages, for the workers
(engine/worker_args.py) and for `tandem generate` (launcher/cmd_generate.py). Invalid choices are
refused by argparse."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.main import tune_loop
from engine.build import build_engine_parts, load_model
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.step_trace import StepTrace
from engine.worker_args import add_worker_args, engine_config
from launcher import cmd_generate


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem decode-worker")
    add_worker_args(p, port=7200, metrics_port=9200)
    return p


def _refused(p: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        p.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ---- --collect-order ---------------------------------------------------------------------------------------
def _decode_engine(order: str) -> DecodeEngine:
    a = worker_parser().parse_args(["--random-weights", "tiny-a", "--kv-cache-gib", "0.002", "--max-num-seqs", "4",
                                    "--max-num-batched-tokens", "32", "--max-model-len", "256",
                                    *(["--collect-order", order] if order else [])])
    engine = DecodeEngine(build_engine_parts(engine_config(a)), None, overlap=a.async_decode == "on")
    tune_loop(engine.core, a)  # what decode_worker.main does with the flags
    return engine


@pytest.mark.parametrize("order,collect_first", [("", True), ("ready", True), ("launch", False)])
def test_collect_order_reaches_the_decode_loop(tmp_path, order, collect_first):
    engine = _decode_engine(order)
    core = engine.core
    assert core.overlap and core.collect_ready is collect_first
    # A CPU step is complete when its launch returns, but its runner cannot tell (no event): say so, as a
    # GPU's event would, and the loop collects it before the next launch only under --collect-order ready.
    core.runner.ready = lambda h: True
    core.trace = StepTrace(str(tmp_path / "steps.jsonl"))
    core.scheduler.add(Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=4, temperature=0.0)))
    while core.has_work:
        core.step()
    core.trace.close()
    rows = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    firsts = [r["collected_first"] for r in rows if r["collected"] is not None]
    assert firsts and all(f is collect_first for f in firsts), rows


def test_collect_order_refuses_other_values(capsys):
    assert "invalid choice: 'first'" in _refused(worker_parser(), ["--collect-order", "first"], capsys)


# ---- --dtype ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_worker_dtype_reaches_the_model_and_its_kv(ckpt_factory, dtype):
    a = worker_parser().parse_args(["--checkpoint", ckpt_factory("tiny"), "--dtype", dtype, "--kv-cache-gib", "0.002",
                                    "--max-model-len", "256", "--max-num-seqs", "4"])
    cfg = engine_config(a)
    assert cfg.dtype == dtype
    model = load_model(cfg)
    want = getattr(torch, dtype)
    assert model.dtype == want
    assert model.embed.dtype == want and model.lm_head.dtype == want
    big = [p for p in model.parameters() if p.numel() >= 4096 and p.is_floating_point()]
    assert big and all(p.dtype == want for p in big), {p.dtype for p in big}
    assert build_engine_parts(cfg, model).spec.dtype == want  # --kv-cache-dtype auto: the model's dtype


def test_worker_dtype_defaults_and_choices(capsys):
    p = worker_parser()
    assert engine_config(p.parse_args([])).dtype == "float32"  # CPU
    assert engine_config(p.parse_args(["--device", "cuda", "--moe-backend", "triton"])).dtype == "bfloat16"
    assert engine_config(p.parse_args(["--device", "cuda", "--moe-backend", "triton", "--dtype", "float32"])).dtype \
        == "float32"
    assert "invalid choice: 'float16'" in _refused(p, ["--dtype", "float16"], capsys)


def test_generate_dtype_reaches_its_engine(ckpt_factory, monkeypatch, capsys):
    p = argparse.ArgumentParser()
    cmd_generate.add_engine_args(p)
    assert cmd_generate.engine_config(p.parse_args([])).dtype == "float32"
    assert cmd_generate.engine_config(p.parse_args(["--device", "cuda", "--moe-backend", "triton"])).dtype == "bfloat16"
    assert "invalid choice: 'half'" in _refused(p, ["--dtype", "half"], capsys)
    made = []

    class Recording(cmd_generate.LLM):
        def __init__(self, cfg) -> None:
            super().__init__(cfg)
            made.append(self)

    monkeypatch.setattr(cmd_generate, "LLM", Recording)
    assert cmd_generate.generate(["--checkpoint", ckpt_factory("tiny"), "--dtype", "bfloat16",
                                  "--kv-cache-gib", "0.002", "--max-model-len", "256",
                                  "--prompt-ids", "1,2,3", "--max-tokens", "1"]) == 0
    (llm,) = made
    model = llm.engine.model
    assert llm.engine.cfg.dtype == "bfloat16" and model.dtype == torch.bfloat16 and model.embed.dtype == torch.bfloat16
    out = capsys.readouterr().out
    assert out.startswith("req-0: ") and out.rstrip().endswith("[length]"), out


@pytest.mark.parametrize("argv,graphs,pieces", [
    ([], False, False),
    (["--device", "cuda"], True, True),
    (["--device", "cuda", "--no-cuda-graphs", "--no-piecewise-graphs"], False, False),
    (["--cuda-graphs", "--piecewise-graphs"], False, True)])
def test_generate_graph_flags_follow_the_device(argv: list[str], graphs: bool, pieces: bool) -> None:
    """`tandem generate` on a GPU replays decode steps and the pieces of prefill steps as CUDA graphs, as a decode
    worker does (the offline engine captures its decode graphs itself: EngineConfig.cuda_graphs)."""
    p = argparse.ArgumentParser()
    cmd_generate.add_engine_args(p)
    cfg = cmd_generate.engine_config(p.parse_args(argv))
    assert (cfg.cuda_graphs, cfg.piecewise_graphs) == (graphs, pieces)


def test_offline_engine_refuses_cuda_graphs_on_a_cpu(ckpt_factory):
    from common.errors import ConfigError
    from engine.build import EngineConfig
    from engine.llm import LLM

    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        LLM(EngineConfig(checkpoint=ckpt_factory("tiny"), kv_cache_bytes=1 << 20, cuda_graphs=True))


@pytest.mark.parametrize("argv,graphs,pieces", [
    ([], False, False),  # the CPU: neither (no CUDA graphs there; pieces on a CPU only copy)
    (["--device", "cuda"], True, True),  # a GPU: both, unless turned off
    (["--device", "cuda:1", "--no-piecewise-graphs"], True, False),
    (["--device", "cuda", "--no-cuda-graphs"], False, True),
    (["--piecewise-graphs", "--cuda-graphs"], False, True),  # no CUDA graphs on a CPU, asked or not
    (["--device", "cuda", "--tp", "2"], True, False),  # no run has captured pieces with a TP group's all-reduces yet
    (["--device", "cuda", "--tp", "2", "--piecewise-graphs"], True, True)])
def test_graph_flags_default_on_a_gpu(argv: list[str], graphs: bool, pieces: bool) -> None:
    """--cuda-graphs / --piecewise-graphs unset follow the device (engine/worker_args.cuda_graphs_on, piecewise_on):
    the decode worker captures its decode graphs on what cuda_graphs_on says, the EngineConfig carries the pieces."""
    from engine.worker_args import cuda_graphs_on, piecewise_on

    a = worker_parser().parse_args(argv)
    assert cuda_graphs_on(a) is graphs
    assert piecewise_on(a) is pieces
    if a.tp == 1:  # (a TP rank's config needs its group)
        assert engine_config(a).piecewise_graphs is pieces


@pytest.mark.parametrize("argv,decode,prefill", [
    ([], "none", "none"),  # the CPU: islands (the graphed kernel is Triton's; the pieces only copy there)
    (["--device", "cuda"], "all", "none"),  # a decode worker's mixed steps in one graph; a prefill worker streams KV
    (["--device", "cuda", "--kv-cache-dtype", "fp8"], "none", "none"),  # e4m3 pages: islands until GPU-tested
    (["--device", "cuda", "--kv-cache-dtype", "fp8", "--piecewise-graphed-attention", "all"], "all", "all"),
    (["--device", "cuda", "--piecewise-graphed-attention", "none"], "none", "none"),
    (["--device", "cuda", "--piecewise-graphed-attention", "sliding"], "sliding", "sliding")])
def test_graphed_attention_default_by_role(argv: list[str], decode: str, prefill: str) -> None:
    """--piecewise-graphed-attention unset: every layer's attention inside the pieces (steps up to 768 tokens) on a
    decode worker on a GPU over bf16 pages, islands on a prefill worker and over e4m3 pages; a value given holds for
    both roles."""
    a = worker_parser().parse_args(argv)
    assert engine_config(a, role="decode").piecewise_graphed == decode
    assert engine_config(a, role="prefill").piecewise_graphed == prefill
    assert engine_config(a, role="decode").piecewise_graphed_max_tokens == 768
