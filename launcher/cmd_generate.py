"""`tandem generate`: offline generation from token ids with the single-process engine."""

from __future__ import annotations

import argparse

from engine.build import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.worker_args import cuda_graphs_on
from engine.scheduler import SchedulerConfig
from kernels.registry import auto_moe_backend


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="HF-layout directory (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--fp8", action="store_true", help="FP8 128x128 block-scaled weights")
    p.add_argument("--attention-backend", default=None,
                   choices=["torch", "triton", "flashinfer", "flashinfer-triton-decode"])
    p.add_argument("--linear-backend", default=None, choices=["torch", "scaled_mm", "triton", "deepgemm"])
    p.add_argument("--moe-backend", default=None, choices=["torch", "triton", "deepgemm"])
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "fp32"])
    p.add_argument("--kv-scale-calibration", type=int, default=0, metavar="N")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay pure-decode steps as CUDA graphs captured at start-up (default: on a GPU; "
                        "a CPU has none)")
    p.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill and mixed steps replay CUDA graphs between their attention calls "
                        "(engine/piecewise.py; default: on a GPU)")


def engine_config(a: argparse.Namespace, **extra) -> EngineConfig:
    gpu = a.device.startswith("cuda")
    return EngineConfig(
        checkpoint=a.checkpoint, device=a.device, fp8=a.fp8,
        dtype=a.dtype or ("bfloat16" if gpu else "float32"),
        attention_backend=a.attention_backend or ("flashinfer" if gpu else "torch"),
        linear_backend=a.linear_backend or ("scaled_mm" if gpu and a.fp8 else "torch"),
        moe_backend=a.moe_backend or auto_moe_backend(a.device, a.fp8, whole_experts=True),
        kv_cache_bytes=int(a.kv_cache_gib * 2**30) if a.kv_cache_gib else None,
        kv_cache_dtype=a.kv_cache_dtype, kv_scale_calibration=a.kv_scale_calibration,
        scheduler=SchedulerConfig(a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len),
        seed=a.seed, progress=True, cuda_graphs=cuda_graphs_on(a),
        piecewise_graphs=gpu if a.piecewise_graphs is None else a.piecewise_graphs, **extra)


def generate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem generate", description="generate from prompt token ids")
    add_engine_args(p)
    p.add_argument("--prompt-ids", action="append", required=True,
                   help="comma-separated token ids; repeat the flag for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)
    a = p.parse_args(argv)
    prompts = [[int(t) for t in s.split(",") if t.strip()] for s in a.prompt_ids]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.sample_seed)
    llm = LLM(engine_config(a))
    for c in llm.generate(prompts, params):
        print(f"{c.request_id}: {','.join(map(str, c.output_ids))}  [{c.finish_reason.value}]")
    return 0
