"""Build an engine's parts from one frozen EngineConfig: load the checkpoint, choose and log the
backends, size the KV cache in its dtype (logging the capacity of each page group, and what the other
KV dtype would give), pick the FP8 KV scales (engine/kv_calibration.py), wire scheduler and runner."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.errors import ConfigError
from engine.runner import ModelRunner
from engine.sampling import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from kernels.registry import DEFAULT_FUSIONS, Backends, Fusion, make_backends
from model.checkpoint_io import ensure_checkpoint
from model.gpt_oss import GptOss
from model.config import GptOssConfig
from model.kv_cache import (KVCacheSpec, KVManager, KVPool, PageGroup, kv_dtype_name, plan_kv_cache,
                            resolve_kv_dtype)
from model.kv_scales import FP8_KV_DTYPE, is_fp8
from model.loader import load_weights
from model.parallel import ParallelConfig
from model.weights import RandomSource, SafetensorsSource, TensorSource

log = logging.getLogger("tandem.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CACHE = Path.home() / ".cache" / "tandem" / "checkpoints"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    checkpoint: str | None = None  # a directory in the HF layout; None = the embedded tiny model
    random_preset: str | None = None  # full-size random weights generated on the device (benchmarks)
    random_layers: int | None = None  # with random_preset: keep the real widths, use this many layers
    dtype: str = "float32"
    fp8: bool = False
    fp8_attention: bool | None = None  # None: same as fp8 (decode workers on GPU choose bf16)
    device: str = "cpu"
    attention_backend: str = "torch"
    linear_backend: str = "torch"
    moe_backend: str = "torch"
    fusions: str = DEFAULT_FUSIONS  # kernels.registry.parse_fusions: off | on | names joined by '+'
    # keep the checkpoint's MXFP4 experts beside the compute copy, for Fusion.MXFP4_MOE (an experiment: ~half the
    # FP8 experts' memory again; an MXFP4 checkpoint with whole experts only, model.loader)
    mxfp4_experts: bool = False
    page_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (= dtype) | bf16 | fp8 (e4m3, per layer/head scales) | fp32
    kv_scale_calibration: int = 0  # FP8 KV without checkpoint scales: calibrate on this many prompts (0 = 1.0)
    kv_cache_bytes: int | None = None  # explicit budget; else kv_cache_fraction of free memory (GPU)
    kv_cache_fraction: float = 0.85
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    cache_dir: str = str(DEFAULT_CACHE)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    progress: bool = False
    async_decode: bool = True  # overlapped step loop (engine.core); False: every step synchronous
    enable_prefix_caching: bool = True  # model/prefix_cache.py
    # engine/piecewise.py: eager steps (prefill chunks, mixed steps) up to the largest bucket replay CUDA
    # graphs between their attention calls; captured here at start-up (a CPU runs the pieces directly)
    piecewise_graphs: bool = False
    # Buckets stop here: above ~2k tokens a 20b step is GPU-bound and padding to the next bucket costs
    # more than the launches saved (3.3-3.6k-token chunks 7-13 % slower in the 4,096 bucket, piecewise-ab-1)
    piecewise_max_tokens: int = 2048
    # with piecewise_graphed: attention inside the graphs only for buckets up to this many tokens (0: all);
    # graphed-small-ab-1 / launch-hold-bubble-ab-1 (H100): a ~300-token mixed step launches in 3.7 vs 13.1 ms with
    # it, a ~4k-token chunk in 51.9 vs 31.9 ms: long chunks keep their attention as islands
    piecewise_graphed_max_tokens: int = 768
    piecewise_buckets: str = "fine"  # engine.piecewise.BUCKET_SETS: "fine" (1.5x apart) or "pow2" (2x)
    # attention inside the piecewise graphs too (kernels/triton_graph_attention.py): "none", "sliding" (the
    # sliding-window layers') or "all" (a step is one graph); a decode worker on a GPU asks for "all"
    # (engine/worker_args.graphed_attention), the offline engine keeps islands unless asked
    piecewise_graphed: str = "none"
    # the offline engine (engine.llm.LLMEngine) replays pure-decode steps as CUDA graphs (engine/decode_graphs.py),
    # captured at start-up per batch bucket up to scheduler.max_num_seqs; a decode worker captures its own
    # (--cuda-graphs)
    cuda_graphs: bool = False


@dataclass(slots=True)
class EngineParts:
    model: GptOss
    spec: KVCacheSpec
    pool: KVPool
    kv: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler


def open_source(cfg: EngineConfig) -> TensorSource:
    if cfg.random_preset is not None:
        from model.config import preset

        pcfg = preset(cfg.random_preset)
        if cfg.random_layers:
            pcfg = dataclasses.replace(pcfg, num_hidden_layers=cfg.random_layers, layer_types=())
        return RandomSource(pcfg, cfg.seed, fast_mxfp4=True)
    path = cfg.checkpoint or str(ensure_checkpoint("tiny", cfg.cache_dir))
    return SafetensorsSource(path)


def load_model(cfg: EngineConfig) -> GptOss:
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    src = open_source(cfg)
    backends = make_backends(cfg.attention_backend, cfg.linear_backend, cfg.moe_backend, cfg.fusions)
    model = GptOss(src.config, backends, dtype=DTYPES[cfg.dtype], fp8=cfg.fp8, parallel=cfg.parallel,
                   device=cfg.device, fp8_attention=cfg.fp8_attention)
    prepare_backends(backends, cfg.device, dense_shapes(model))
    if Fusion.MXFP4_MOE.value in cfg.fusions and not cfg.mxfp4_experts:  # named ("on" does not warn)
        log.warning("fusion mxfp4_moe is named but the MXFP4 experts are not kept (--mxfp4-experts): it will not apply")
    stats = load_weights(model, src, progress=cfg.progress, keep_mxfp4=cfg.mxfp4_experts)
    log.info("model: %d layers, %d experts, dtype %s, fp8=%s, tp=%d (%s); backends: %s",
             src.config.num_hidden_layers, src.config.num_local_experts, cfg.dtype, cfg.fp8, cfg.parallel.tp_size,
             cfg.parallel.moe_mode.value, backends.describe())
    if cfg.fp8:
        log.info("FP8 experts: %d/%d tiles not exact, rel. err %.2e", stats.inexact_tiles, stats.tiles, stats.rel_err)
    return model


def dense_shapes(model: GptOss) -> list[tuple[int, int, bool]]:
    """(N, K, has bias) of each FP8 dense weight the linear backend will see (the attention
    projections; bf16 ones bypass it). Rank-dependent under TP: only one rank adds O's bias."""
    out = []
    for layer in model.layers:
        a = layer.attn
        for w, s, b in ((a.qkv_w, a.qkv_s, a.qkv_b), (a.o_w, a.o_s, a.o_b)):
            if s is not None:
                out.append((w.shape[0], w.shape[1], b is not None))
    return list(dict.fromkeys(out))


def prepare_backends(backends: Backends, device: str, dense: list[tuple[int, int, bool]] = ()) -> None:
    """Backends that build or load native code (DeepGEMM launchers) do it at start-up: a missing
    toolchain is a clear start-up error, not a failed request later. `dense`: the linear backend's
    weight shapes (DeepGEMM compiles N and K into each launcher)."""
    if not device.startswith("cuda"):
        return
    dev = torch.device(device)
    for impl, args in ((backends.linear, (dev, dense)), (backends.moe, (dev,))):
        prepare = getattr(impl, "prepare", None)
        if prepare is not None:
            try:
                prepare(*args)
            except (ConfigError, OSError, RuntimeError) as e:
                raise ConfigError(f"{impl.name} backend cannot start on {device}: {e}") from e


def kv_budget(cfg: EngineConfig) -> int:
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if cfg.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(cfg.device))
        return int(free * cfg.kv_cache_fraction)
    return 256 << 20  # CPU default: 256 MiB


def build_engine_parts(cfg: EngineConfig, model: GptOss | None = None) -> EngineParts:
    model = model or load_model(cfg)
    spec = plan_and_log_kv(model.cfg, kv_budget(cfg), resolve_kv_dtype(cfg.kv_cache_dtype, model.dtype),
                           page_size=cfg.page_size, max_num_seqs=cfg.scheduler.max_num_seqs,
                           tp_size=cfg.parallel.tp_size, cached_tails=1.0 if cfg.enable_prefix_caching else 0.0)
    scales = None
    if is_fp8(spec.dtype):
        from engine.kv_calibration import kv_scales_for

        scales = kv_scales_for(model, cfg.kv_scale_calibration)
    pool = KVPool(spec, cfg.device, scales=scales, kv_heads=model.par.kv_heads(model.cfg))
    kv = KVManager(spec, cache_identity(model, spec) if cfg.enable_prefix_caching else None)
    scheduler = Scheduler(cfg.scheduler, kv, model.cfg.eos_token_ids)
    sampler = Sampler(torch.device(cfg.device), cfg.seed, model.cfg.eos_token_ids)
    sampler.warm_up(model.cfg.vocab_size)
    runner = ModelRunner(model, pool, sampler)
    if cfg.piecewise_graphs:
        runner.piecewise = make_piecewise(cfg, model, pool)
        runner.piecewise.capture()
    return EngineParts(model, spec, pool, kv, scheduler, runner, sampler)


def make_piecewise(cfg: EngineConfig, model: GptOss, pool: KVPool, *, buckets: str | None = None,
                   graphed: str | None = None):
    """The engine's piecewise graphs, not captured yet: cfg's bucket spacing and graphed attention, or the
    ones named (benchmarks/mixed_step.py builds other sets beside the engine's for its A/B)."""
    from engine.piecewise import BUCKET_SETS, GRAPHED, PiecewiseGraphs, buckets_for

    spec = pool.spec
    groups = frozenset(g for g in GRAPHED[graphed or cfg.piecewise_graphed]
                       if (spec.sliding_layers if g == PageGroup.SLIDING else spec.full_layers))
    if groups and not (cfg.device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1"):
        log.warning("--piecewise-graphed-attention runs Triton kernels: a GPU, or TRITON_INTERPRET=1 on a CPU")
        groups = frozenset()
    sizes = buckets_for(min(cfg.scheduler.max_num_batched_tokens, cfg.piecewise_max_tokens),
                        BUCKET_SETS[buckets or cfg.piecewise_buckets])
    limit = cfg.piecewise_graphed_max_tokens
    small = tuple(b for b in sizes if b <= limit) if groups and limit > 0 else sizes
    if not small:  # the limit is below every bucket: no step has its attention in the graphs
        return PiecewiseGraphs(model, sizes, pool=pool)
    pw = PiecewiseGraphs(model, small, pool=pool, graphed=groups, max_seqs=cfg.scheduler.max_num_seqs,
                         max_model_len=cfg.scheduler.max_model_len)
    if len(small) == len(sizes):
        return pw
    # attention in the graphs up to the limit, as islands above it (engine.piecewise.PiecewiseSplit)
    from engine.piecewise import PiecewiseSplit

    return PiecewiseSplit(pw, PiecewiseGraphs(model, sizes[len(small):], pool=pool))


def plan_and_log_kv(model_cfg: GptOssConfig, budget: int, dtype: torch.dtype, *, page_size: int, max_num_seqs: int,
                    tp_size: int, cached_tails: float = 0.0) -> KVCacheSpec:
    """The KV spec a worker starts with, logged; also logs what the same budget gives in the other
    KV dtype (bf16 <-> FP8), so an operator sees the trade at start-up. Needs no weights
    (benchmarks/kv_capacity.py runs it for the real presets on a CPU)."""
    spec = plan_kv_cache(model_cfg, budget, page_size=page_size, max_num_seqs=max_num_seqs, tp_size=tp_size,
                         dtype=dtype, cached_tails=cached_tails)
    log_kv_capacity(spec)
    other = torch.bfloat16 if is_fp8(dtype) else FP8_KV_DTYPE
    try:
        log_kv_capacity(plan_kv_cache(model_cfg, budget, page_size=page_size, max_num_seqs=max_num_seqs,
                                      tp_size=tp_size, dtype=other, cached_tails=cached_tails), alternative=True)
    except ConfigError as e:
        log.info("KV cache would not fit in %s: %s", kv_dtype_name(other), e)
    return spec


def model_fingerprint(model: GptOss) -> str:
    """Names the model in the KV compatibility check and the prefix cache: same config, same KV meaning."""
    cfg = model.cfg.to_hf_dict()
    cfg.pop("quantization_config", None)
    return "gpt-oss-" + hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def cache_identity(model: GptOss, spec: KVCacheSpec) -> str:
    """The prefix cache's hash-chain seed (common.prefix_hash): the model, page size and KV dtype.
    Workers publish it so the router hashes prompts the same way."""
    return f"{model_fingerprint(model)}/page{spec.page_size}/{str(spec.dtype).removeprefix('torch.')}"


def log_kv_capacity(spec: KVCacheSpec, alternative: bool = False) -> None:
    full, sliding = spec.num_pages[PageGroup.FULL], spec.num_pages[PageGroup.SLIDING]
    per_token = spec.page_bytes(PageGroup.FULL) // spec.page_size
    log.info("%s %s: %.2f GiB; full-attention group %d pages = %d tokens (%d bytes/token); sliding group %d "
             "pages = %d rings of %d pages (window %d, page %d, %.2f MiB/ring)",
             "KV cache would be, in" if alternative else "KV cache", kv_dtype_name(spec.dtype),
             spec.total_bytes() / 2**30, full, full * spec.page_size, per_token, sliding,
             sliding // max(spec.ring_pages, 1), spec.ring_pages, spec.sliding_window, spec.page_size,
             spec.ring_pages * spec.page_bytes(PageGroup.SLIDING) / 2**20)
