"""Flags shared by `tandem prefill-worker` and `tandem decode-worker` (helm values map onto them)."""

from __future__ import annotations

import argparse
import os
import socket
import uuid

from engine.build import EngineConfig
from engine.scheduler import SchedulerConfig
from engine.tp.group import rank_device
from kernels.registry import DEFAULT_FUSIONS, auto_moe_backend
from model.parallel import MoEMode, ParallelConfig


def add_worker_args(p: argparse.ArgumentParser, *, port: int, metrics_port: int) -> None:
    p.add_argument("--checkpoint", default=None, help="HF-layout directory (default: the embedded tiny model)")
    p.add_argument("--random-weights", default=None, metavar="PRESET",
                   help="full-size random weights generated on the device (benchmarks), e.g. gpt-oss-20b")
    p.add_argument("--host", default="127.0.0.1", help="address to bind the router-facing socket on")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--metrics-port", type=int, default=metrics_port, help="HTTP /health /ready /metrics; 0 = off")
    p.add_argument("--advertise-host", default=None, help="address peers use to reach this worker (default: --host)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--fp8", action="store_true", help="FP8 128x128 block-scaled experts (and projections, see below)")
    p.add_argument("--fp8-attention", choices=["auto", "on", "off"], default="auto",
                   help="QKV/O projections in FP8 too; auto = off: bf16 projections are faster at decode sizes "
                        "(measured), and prefill and decode workers must agree so disaggregated output equals "
                        "single-process output")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: this many processes, rank r on cuda:r")
    p.add_argument("--tp-timeout-s", type=float, default=60.0,
                   help="deadline of one collective between TP ranks (a stuck rank ends the worker)")
    p.add_argument("--moe-mode", choices=["tp", "ep"], default="tp")
    p.add_argument("--fast-allreduce-kib", type=int, default=1024,
                   help="with --tp > 1 on GPUs: all-reduces up to this size use the symmetric-memory "
                        "one-shot kernel (decode-sized), larger ones NCCL; 0 = NCCL only")
    p.add_argument("--vocab-parallel", action="store_true",
                   help="with --tp > 1: split lm_head by vocabulary rows (one all-gather of the logits) "
                        "instead of replicating it")
    p.add_argument("--fast-allreduce-impl", choices=["torch", "tandem"], default="torch",
                   help="one-shot kernel: torch's symm_mem op, or ours (one program per SM)")
    p.add_argument("--attention-backend", default=None,
                   choices=["torch", "triton", "flashinfer", "flashinfer-triton-decode"])
    p.add_argument("--linear-backend", default=None, choices=["torch", "scaled_mm", "triton", "deepgemm"])
    p.add_argument("--moe-backend", default=None, choices=["torch", "triton", "deepgemm"])
    p.add_argument("--fusions", default=DEFAULT_FUSIONS,
                   help="launch-saving kernel fusions (kernels.registry.Fusion): off, on, or '+'-joined names of "
                        f"rope_store, norm_router, norm_quant (default {DEFAULT_FUSIONS}: measured, see kernels/registry.py). "
                        "rope_store and norm_quant keep the bits; norm_router's logits may differ in the last bit")
    p.add_argument("--mxfp4-experts", action="store_true",
                   help="also keep the checkpoint's MXFP4 experts (an MXFP4 checkpoint with whole experts; ~half the "
                        "FP8 experts' memory again), for --fusions ...+mxfp4_moe: one-token steps on W4A16 experts "
                        "(kernels/moe_mxfp4.py, an experiment of issue 27)")
    p.add_argument("--kv-backend", default="nixl", choices=["nixl", "ipc", "loopback", "none"],
                   help="KV transfer (kv_transfer.factory.TransferBackend): nixl; ipc = NIXL control plane, "
                        "same-node data path through shared/IPC-mapped pools (CUDA IPC on GPU, shared memory "
                        "on CPU); loopback (in-process); none")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "fp32"],
                   help="KV pages: auto = the model dtype; fp8 = e4m3 with per-layer/head scales (half of bf16's "
                        "bytes per token). Prefill and decode workers must agree (the KV handshake refuses otherwise)")
    p.add_argument("--kv-scale-calibration", type=int, default=0, metavar="N",
                   help="FP8 KV without scales in the checkpoint: measure K/V amax on N built-in prompts at start-up "
                        "(power-of-two scales); 0 = scales of 1.0. Both roles must use the same N")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--kv-cache-fraction", type=float, default=0.85)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=131072)
    # Both default to on where the device is a GPU (cuda_graphs_on, piecewise_on; the pieces at --tp 1 only: no run
    # has captured them with a tensor-parallel group's all-reduces yet): every served GPU figure since 2026-12-03 ran
    # the decode worker with both, and a prefill worker's short prompts (a cached turn's suffix) are host-launch-bound
    # without the pieces (piecewise-ab-1: 352 tokens in 15.4 ms instead of 24.6). Until 2026-12-07 both were opt-in,
    # so a worker started without them (the Helm chart never passed --piecewise-graphs) launched every mixed step and
    # short prefill op by op.
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode worker: pure-decode steps replay CUDA graphs captured at start-up per batch-size "
                        "bucket (default: on a GPU)")
    p.add_argument("--piecewise-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="eager steps (prefill chunks, mixed steps) of up to --piecewise-max-tokens replay CUDA graphs "
                        "captured at start-up per token-count bucket between their attention calls "
                        "(engine/piecewise.py); a decode worker's pure-decode graphs (--cuda-graphs) are unchanged "
                        "(default: on a GPU at --tp 1)")
    p.add_argument("--piecewise-max-tokens", type=int, default=2048,
                   help="the largest piecewise bucket: longer steps run eagerly (GPU-bound there, where padding "
                        "to a bucket costs more than the launches it saves)")
    # A decode worker on a GPU holds every layer's attention inside the graphs of steps up to 768 tokens by default
    # (a cached turn's mixed step, H100 A/Bs: graphed-small-ab-1 launched it in 3.7 ms instead of 13.1, cached TTFT p99
    # 79.5 -> 61.9 ms; graphed-default-check-1 14.6 -> 6.3 ms, p99 936 -> 91 ms, TPOT within noise). Opt-in until
    # 2026-12-07, when its kernel got split-KV for long rows (kernels/attention_splits.py) and the piecewise GPU tests
    # passed (graph-tests-2: the graphs equal eager Triton bit for bit). Its Triton kernel does not give FlashInfer's
    # bits, which never held between the roles anyway: a decode worker reads mixed steps on fa2, a prefill worker its
    # prompts on fa3. A prefill worker keeps islands (a graphed layer's KV would stream out only after its piece, and
    # long chunks run slower on the kernel).
    p.add_argument("--piecewise-graphed-attention", choices=["none", "sliding", "all"], default=None,
                   help="with --piecewise-graphs: attention inside the graphs too (a Triton kernel on per-step tables): "
                        "the sliding-window layers' (only full-attention layers stay eager), or all (a step up to the "
                        "largest bucket is one graph), for steps up to --piecewise-graphed-max-tokens (default: all on "
                        "a decode worker on a GPU over bf16 pages, none on a prefill worker and on e4m3 pages)")
    p.add_argument("--piecewise-graphed-max-tokens", type=int, default=768, metavar="N",
                   help="with --piecewise-graphed-attention: only steps of at most N tokens (a cached turn's mixed "
                        "step) run their attention inside the graphs; larger ones keep it as eager islands (0: all)")
    p.add_argument("--piecewise-buckets", choices=["pow2", "fine"], default="fine",
                   help="piecewise bucket spacing: fine (1.5x apart: 16, 24, 32, 48, ...; less padding, whose rows the "
                        "MoE computes like real ones, for about twice the graphs in the same pool) or pow2 (16, 32, 64, ...)")
    p.add_argument("--step-trace", default=None, metavar="PATH",
                   help="write one JSON line per engine step to PATH (%%p = the process id): sizes and host times "
                        "of each step, for diagnosing served latency (engine/step_trace.py)")
    p.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="run a few throw-away requests through the step loop before reporting ready, so kernel "
                        "compiles and first-use paths cost start-up time, not a request's TTFT (engine/warmup.py); "
                        "auto: on a GPU")
    p.add_argument("--async-decode", choices=["on", "off"], default="on",
                   help="overlapped step loop: the host schedules step N+1 while the GPU runs step N; "
                        "tokens reach the host one step later and a stop token costs one dropped token")
    p.add_argument("--collect-order", choices=["ready", "launch"], default="ready",
                   help="decode workers' overlapped loop (engine/core.py; prefill workers ignore it): ready = a step "
                        "the GPU already finished is collected before the next launch (its tokens leave one launch "
                        "earlier); launch = always launch the next step first")
    p.add_argument("--first-token-wait-ms", type=float, default=0.0,
                   help="overlapped loop: wait up to this long for a step that sampled prompts' first tokens "
                        "before planning the next one (engine/core.py); 0 = off, the default: measured worse served "
                        "(multi-turn-colocated-pw-10/11: cached turns' TTFT p50 51.6 / 69.0 ms with 3 ms, 42.3 / 57.6 without)")
    p.add_argument("--launch-hold", action=argparse.BooleanOptionalAction, default=False,
                   help="decode worker, overlapped loop on a GPU: hold the next step's launch until shortly before "
                        "the step in flight is predicted to end, handling arrivals meanwhile, so a new request joins "
                        "the next step rather than the one after it (engine/launch_hold.py)")
    p.add_argument("--launch-hold-bubble", type=float, default=0.0, metavar="FRAC",
                   help="with --launch-hold: a prompt arriving in the hold joins the next step while its launch (at "
                        "the median) would leave the GPU idle for at most this share of a step (0: only while it "
                        "fits with the margin)")
    p.add_argument("--prefill-steps", choices=["mixed", "separate"], default="mixed",
                   help="mixed: prompt chunks share a step with the decode rows; separate: a step with prompt work runs "
                        "it alone and the next one decodes (a new prompt's first token waits only for its own step, "
                        "decoding sequences for one more step; never two prompt-only steps in a row)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="content-addressed KV pages kept after a request ends and reused by later prompts "
                        "with the same prefix (model/prefix_cache.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on SIGTERM: stop taking requests, finish those in flight for at most this long, then "
                        "end the rest (finish_reason abort, 'worker drain deadline reached') and exit; the "
                        "supervisor's grace period must exceed it by a few seconds")
    p.add_argument("--kv-port", type=int, default=0,
                   help="decode: first KV side-channel port (rank r binds kv-port + r); 0 = any free port. A fixed "
                        "port lets a worker restarted on the same address refuse its predecessor's KV promises "
                        "by epoch at once, instead of its peers waiting out their transfer deadline")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads when --device cpu (workers share the host's cores)")


def cuda_graphs_on(a: argparse.Namespace) -> bool:
    """The decode worker captures its decode graphs: on a GPU, unless --no-cuda-graphs (the comment at the flags)."""
    return a.device.startswith("cuda") and a.cuda_graphs is not False


def piecewise_on(a: argparse.Namespace) -> bool:
    """--piecewise-graphs as given, else on a GPU at --tp 1 (the comment at the flags)."""
    return a.device.startswith("cuda") and a.tp == 1 if a.piecewise_graphs is None else a.piecewise_graphs


def graphed_attention(a: argparse.Namespace, role: str) -> str:
    """--piecewise-graphed-attention as given, else all on a decode worker on a GPU over bf16 pages, none elsewhere
    (the comment at the flag). e4m3 pages (--kv-cache-dtype fp8) keep islands until their graphed path passes its GPU
    test: checked on the CPU against eager Triton (tests/integration/test_piecewise.py); on an H100 (graph-tests-4)
    test_piecewise_gpu.py's all-e4m3 engine read 0.034 from eager Triton at T=1 against a 0.03 bound, where the two
    eager backends were 0.039 apart (bound since set to that rule, not rerun)."""
    if a.piecewise_graphed_attention is not None:
        return a.piecewise_graphed_attention
    return "all" if role == "decode" and a.device.startswith("cuda") and a.kv_cache_dtype != "fp8" else "none"


def engine_config(a: argparse.Namespace, *, role: str = "decode", tp_rank: int = 0, group=None) -> EngineConfig:
    gpu = a.device.startswith("cuda")
    # One choice for both roles: KV computed by a prefill worker must be the KV the decode worker
    # would have computed itself, or greedy outputs diverge from the single-process engine.
    fp8_attn = a.fp8_attention == "on"
    return EngineConfig(
        checkpoint=a.checkpoint, random_preset=a.random_weights, device=rank_device(a.device, tp_rank), fp8=a.fp8,
        fp8_attention=fp8_attn,
        dtype=a.dtype or ("bfloat16" if gpu else "float32"),
        attention_backend=a.attention_backend or ("flashinfer" if gpu else "torch"),
        linear_backend=a.linear_backend or ("scaled_mm" if gpu and a.fp8 else "torch"),
        fusions=a.fusions, mxfp4_experts=a.mxfp4_experts,
        moe_backend=a.moe_backend or auto_moe_backend(rank_device(a.device, tp_rank), a.fp8,
                                                      a.tp == 1 or a.moe_mode == MoEMode.EP.value),
        page_size=a.page_size, kv_cache_dtype=a.kv_cache_dtype, kv_scale_calibration=max(0, a.kv_scale_calibration),
        kv_cache_bytes=int(a.kv_cache_gib * 2**30) if a.kv_cache_gib else None,
        kv_cache_fraction=a.kv_cache_fraction,
        scheduler=SchedulerConfig(a.max_num_seqs, a.max_num_batched_tokens, a.max_model_len, a.prefill_steps),
        seed=a.seed, progress=tp_rank == 0, async_decode=a.async_decode == "on",
        enable_prefix_caching=a.enable_prefix_caching, piecewise_graphs=piecewise_on(a),
        piecewise_max_tokens=a.piecewise_max_tokens, piecewise_buckets=a.piecewise_buckets,
        piecewise_graphed=graphed_attention(a, role), piecewise_graphed_max_tokens=a.piecewise_graphed_max_tokens,
        parallel=ParallelConfig(a.tp, tp_rank, MoEMode(a.moe_mode), group,
                                max(0, a.fast_allreduce_kib) << 10 if gpu else 0, a.fast_allreduce_impl, a.vocab_parallel))


def worker_id(a: argparse.Namespace, role: str) -> str:
    return a.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
