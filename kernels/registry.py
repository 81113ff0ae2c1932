"""Backend selection, once at start-up: an enum per op kind -> implementation (lazy imports, so a
CPU machine never imports FlashInfer or DeepGEMM), plus the optional kernel fusions (`Fusion`,
`--fusions`). The choice is logged by the caller."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from common.errors import ConfigError
from kernels.interface import AttentionImpl, LinearImpl, MoEImpl

log = logging.getLogger(__name__)


class AttentionBackend(str, Enum):
    TORCH = "torch"
    TRITON = "triton"
    FLASHINFER = "flashinfer"
    # FlashInfer, with pure-decode steps over 16-bit pages on the Triton decode kernel too (e4m3 pages
    # always take it): decode-b1-1 / fp8-kv-2 measured it ahead of FlashInfer at batch 1 and 128 x 8k
    FLASHINFER_TRITON_DECODE = "flashinfer-triton-decode"


class LinearBackend(str, Enum):
    TORCH = "torch"
    SCALED_MM = "scaled_mm"  # torch._scaled_mm block-scaled FP8 (cuBLAS) + bias epilogue
    TRITON = "triton"
    DEEPGEMM = "deepgemm"  # DeepGEMM's SM90 kernel through our launcher, bias in an extra K block


class MoEBackend(str, Enum):
    TORCH = "torch"
    TRITON = "triton"
    DEEPGEMM = "deepgemm"  # prefill-sized batches on DeepGEMM's grouped GEMM, smaller ones Triton


class Fusion(str, Enum):
    """Launch-saving fusions, each switchable so one run can A/B it (benchmarks.bench_model --fusions).
    The default is DEFAULT_FUSIONS. The norm fusions need the Triton norms (`Backends.fused_norm`)."""

    ROPE_STORE = "rope_store"  # q and k RoPE + the K/V page store in one launch (triton_store_kv.rope_qk_store_kv)
    NORM_ROUTER = "norm_router"  # the MoE router GEMV inside the add + RMSNorm launch, few tokens (kernels/norm.py)
    # the FP8 MoE's 1x128 input quantisation inside the add + RMSNorm launch (both MoE paths take it; the few-token
    # path's gate_up CTAs then skip their own, ~2 us a layer at one token: b1-probes-2), up to NORM_QUANT_MAX_TOKENS
    NORM_QUANT = "norm_quant"
    # bf16 QKV / O projections of one-token steps on kernels/gemv.py (whole W rows per program, one launch,
    # deterministic) instead of cuBLASLt's addmm. Not bit-identical to addmm (another summation order).
    # gemv-rows-ab-1 (H100): QKV 12.01 vs 12.96 us, O 10.49 vs 13.72; 20b 8k x 1 replay 2.750 -> 2.632 ms
    FEW_TOKEN_LINEAR = "gemv"
    # FP8 QKV / O projections (--fp8-attention on) of batch-1 steps on kernels/dense_small.py (the few-token MoE's
    # swapped TMA tiles, x quantised in the launch: one launch) instead of the linear backend's two or three.
    # fp8-gemv-ab-1/2: 20b batch-1 replay 2.351 ms (with 64-row tiles) vs 2.394 on DeepGEMM, 2.322 with bf16 QKV/O
    FEW_TOKEN_FP8 = "fp8_gemv"
    # FP8 QKV / O projections (--fp8-attention on) of one-token steps on kernels/fp8_rows.py: whole W rows per
    # program on the CUDA cores, x in bf16 (W8A16: no activation quantisation, no split-K chain). Takes precedence
    # over fp8_gemv; bf16 projections (the default) never reach it. rows-b1-ab-4 (H100): QKV 7.63 / O 6.46 us against
    # dense_small's 10.54 / 9.27; 20b 8k x 1 replay (FP8 QKV/O, e4m3 pages) 2.350 ms against fp8_gemv's 2.458.
    # (A MoE on the same rows kernels lost to the few-token MMA path at every config: rows-b1-ab-1, removed.)
    FP8_ROWS = "fp8_rows"
    # One-token MoE steps on the checkpoint's own MXFP4 experts (kernels/moe_mxfp4.py, W4A16: about half the FP8
    # experts' bytes), where the model kept them (EngineConfig.mxfp4_experts: an MXFP4 checkpoint, whole experts).
    # An experiment of issue 27, not a default: unmeasured on a GPU when added (suite mxfp4-b1).
    MXFP4_MOE = "mxfp4_moe"


# The workers' default (EngineConfig, --fusions), measured by suite fusion-ab (2026-12-03/fusion-ab-1, 20b on
# one H200): rope_store keeps the bits of the three launches it replaces and was faster everywhere (prefill 8k
# 90.5 -> 89.7 ms, decode replay at 8k x 1 2.48 -> 2.41 ms, x 64 10.85 -> 10.75 ms), and a short prefill is
# launch-bound (2026-12-03/prefill-prefix-2: two launches fewer per layer). norm_router (on since 2026-12-06) saves
# cuBLAS's router GEMM + split-K reduce (~6 us a layer at batch 1 on the H100) in decode-sized steps: 8k x 1 2.807
# -> 2.739 ms, x 4 5.606 -> 5.515, x 64 13.46 -> 13.38 (b1-defaults-ab-1, H100; fusion-ab-1, H200: 2.48 -> 2.44 at
# 1); its logits may differ from cuBLAS's in the last bit (another summation order). norm_quant was slower then
# (fusion-ab-1: one program quantised the whole row, 5.2 vs 3.1 us at one token).
# gemv (since 2026-12-06, one-token steps only: FEW_TOKEN_LINEAR_ROUTE_MAX_TOKENS) takes the bf16 attention
# projections off cuBLASLt: 20b 8k x 1 replay 2.750 -> 2.632 ms in one process (gemv-rows-ab-1, H100).
# norm_quant (since 2026-12-06 late, up to NORM_QUANT_MAX_TOKENS) once the norm spread its quantisation over the
# row's programs: 20b 8k x 1 replay 2.148 -> 2.091 ms, x 64 10.255 -> 10.173 (norm-quant-b1-ab-1, H200, one process;
# with it the few-token MoE's gate_up CTAs only route and stream).
# fp8_rows (since 2026-12-07; it only takes FP8 projections, --fp8-attention on): rows-b1-ab-4, above.
# "off" was the default before 2026-12-03, "rope_store" until 2026-12-06, then "norm_router+rope_store", then
# "gemv+norm_router+rope_store", then "gemv+norm_quant+norm_router+rope_store".
DEFAULT_FUSIONS = "fp8_rows+gemv+norm_quant+norm_router+rope_store"

# The router runs inside the norm launch while tokens x experts stays within this (larger steps: one cuBLAS GEMM): the
# fused launch runs T x E/4 programs, each re-deriving its row's norm. fusion-ab-1 (H200): 20b (E 32) 7.5 -> 3.7 us at
# 1 token and 8.2 -> 5.3 at 64; 120b (E 128) 7.6 -> 3.7 at 1 but 8.4 -> 15.6 at 64 (2,048 programs per token set).
ROUTER_FUSION_MAX_WORK = 64 * 32

# The norm quantises the MoE's input up to this many tokens (larger steps: the MoE's own quantisation pass), the
# range where its groups spread over the row's programs and where it was measured (norm-quant-b1-ab-1, H200: at 1
# and 64 tokens). At 8,192 rows the old one-program form lost (fusion-ab-1: 86.5 vs 71.4 us); the form since, which
# quantises from its own loads, is timed at 300-8,192 rows by suite norm-quant-default-check before this rises.
NORM_QUANT_MAX_TOKENS = 64

# Tokens up to which kernels.gemv takes a projection (its BLOCK_M) ...
FEW_TOKEN_LINEAR_MAX_TOKENS = 16
# ... and up to which Fusion.FEW_TOKEN_LINEAR routes the model's there: one token, where the whole-rows kernel beats
# addmm (gemv-rows-ab-1); its MMA split-K path for 2-16 tokens lost to addmm (gemv-ab-1: 13.15 vs 10.28 us at 1)
FEW_TOKEN_LINEAR_ROUTE_MAX_TOKENS = 1
# ... and Fusion.FEW_TOKEN_FP8 the FP8 ones (kernels.dense_small.ROUTE_MAX_TOKENS: it reads W once per token).
FEW_TOKEN_FP8_MAX_TOKENS = 1
# Fusion.FP8_ROWS: one token (each token's programs re-read the weights).
ROWS_MAX_TOKENS = 1
# Fusion.MXFP4_MOE: one token (its programs stream whole expert rows per (token, slot)).
MXFP4_MOE_MAX_TOKENS = 1


def parse_fusions(spec: str) -> frozenset[Fusion]:
    """'off' | 'on' (all) | names joined by '+', e.g. 'rope_store+norm_router'."""
    spec = spec.strip().lower()
    if spec in ("", "off", "none"):
        return frozenset()
    if spec in ("on", "all"):
        return frozenset(Fusion)
    try:
        return frozenset(Fusion(s) for s in spec.split("+"))
    except ValueError:
        raise ConfigError(f"unknown fusion in {spec!r}: off, on, or '+'-joined names of "
                          f"{', '.join(f.value for f in Fusion)}") from None


def fusions_name(fusions: frozenset[Fusion]) -> str:
    if not fusions:
        return "off"
    if fusions == frozenset(Fusion):
        return "on"
    return "+".join(sorted(f.value for f in fusions))


@dataclass(slots=True)
class Backends:
    attention: AttentionImpl
    linear: LinearImpl
    moe: MoEImpl
    fused_norm: bool = False  # Triton RMSNorm / residual-add + RMSNorm (kernels.norm) instead of torch ops
    fusions: frozenset[Fusion] = frozenset()  # mutable on purpose: an A/B run flips it between measurements

    @property
    def fused_rope_store(self) -> bool:
        return Fusion.ROPE_STORE in self.fusions

    def norm_router(self, num_tokens: int, num_experts: int) -> bool:
        """Whether this step's router runs inside the norm launch."""
        return (self.fused_norm and Fusion.NORM_ROUTER in self.fusions
                and num_tokens * num_experts <= ROUTER_FUSION_MAX_WORK)

    def norm_quant(self, num_tokens: int) -> bool:
        """Whether this step's MoE input is quantised inside the norm launch."""
        return (self.fused_norm and Fusion.NORM_QUANT in self.fusions
                and num_tokens <= NORM_QUANT_MAX_TOKENS)

    def mxfp4_moe(self, num_tokens: int) -> bool:
        """Whether this step's MoE runs on the MXFP4 experts (kernels/moe_mxfp4.py), where the model kept them."""
        return Fusion.MXFP4_MOE in self.fusions and num_tokens <= MXFP4_MOE_MAX_TOKENS

    def few_token_linear(self, num_tokens: int, bf16_weight: bool, triton_runs: bool) -> bool:
        """Whether an attention projection runs on kernels.gemv: few tokens and a bf16 weight (FP8 ones keep
        the linear backend), where Triton runs (a GPU tensor, or the interpreter: the CPU tests)."""
        return (Fusion.FEW_TOKEN_LINEAR in self.fusions and bf16_weight
                and num_tokens <= FEW_TOKEN_LINEAR_ROUTE_MAX_TOKENS and triton_runs)

    def attn_linear(self, x, w, w_scale, bias):
        """The attention's QKV / O projection, x [T, K] -> [T, N]: `linear`, or a one/few-token kernel (bf16:
        Fusion.FEW_TOKEN_LINEAR, FP8: Fusion.FP8_ROWS, then Fusion.FEW_TOKEN_FP8). Under TP, w is this rank's
        shard; the caller's all-reduce is unchanged."""
        if Fusion.FP8_ROWS in self.fusions and w_scale is not None and x.shape[0] <= ROWS_MAX_TOKENS:
            from kernels import fp8_rows  # Triton imported only for FP8 projections

            if x.is_cuda or fp8_rows.INTERPRETED:
                return fp8_rows.fp8_rows_linear(x, w, w_scale, bias)
        if Fusion.FEW_TOKEN_FP8 in self.fusions and w_scale is not None and x.shape[0] <= FEW_TOKEN_FP8_MAX_TOKENS:
            from kernels import dense_small  # Triton imported only when the switch is on

            if x.is_cuda or dense_small.INTERPRETED:
                return dense_small.few_token_fp8_linear(x, w, w_scale, bias)
        if Fusion.FEW_TOKEN_LINEAR in self.fusions:  # Triton imported only when the switch is on
            from kernels import gemv

            if self.few_token_linear(x.shape[0], w_scale is None and w.dtype == x.dtype == gemv.BF16,
                                     x.is_cuda or gemv.INTERPRETED):
                return gemv.few_token_linear(x, w, bias)
        return self.linear(x, w, w_scale, bias)

    def describe(self) -> str:
        return (f"attention={self.attention.name} linear={self.linear.name} moe={self.moe.name} "
                f"norm={'triton' if self.fused_norm else 'torch'} fusions={fusions_name(self.fusions)}")


def make_attention(kind: AttentionBackend | str) -> AttentionImpl:
    kind = AttentionBackend(kind)
    if kind == AttentionBackend.TORCH:
        from kernels.torch_backend import TorchAttention
        return TorchAttention()
    if kind == AttentionBackend.TRITON:
        from kernels.triton_attention_backend import TritonAttention
        return TritonAttention()
    if kind in (AttentionBackend.FLASHINFER, AttentionBackend.FLASHINFER_TRITON_DECODE):
        from kernels.flashinfer_backend import FlashInferAttention
        return FlashInferAttention(decode_kernel="triton" if kind == AttentionBackend.FLASHINFER_TRITON_DECODE
                                   else "flashinfer")
    raise ConfigError(f"unknown attention backend {kind}")


def make_linear(kind: LinearBackend | str) -> LinearImpl:
    kind = LinearBackend(kind)
    if kind == LinearBackend.TORCH:
        from kernels.torch_backend import TorchLinear
        return TorchLinear()
    if kind == LinearBackend.SCALED_MM:
        from kernels.fp8_gemm import ScaledMMLinear
        return ScaledMMLinear()
    if kind == LinearBackend.TRITON:
        from kernels.fp8_gemm import TritonFp8Linear
        return TritonFp8Linear()
    if kind == LinearBackend.DEEPGEMM:
        from kernels.deepgemm_linear import DeepGemmLinear
        return DeepGemmLinear()
    raise ConfigError(f"unknown linear backend {kind}")


def make_moe(kind: MoEBackend | str) -> MoEImpl:
    kind = MoEBackend(kind)
    if kind == MoEBackend.TORCH:
        from kernels.torch_backend import TorchMoE
        return TorchMoE()
    if kind == MoEBackend.TRITON:
        from kernels.moe import TritonMoE
        return TritonMoE()
    if kind == MoEBackend.DEEPGEMM:
        from kernels.moe_dg import DeepGemmMoE
        return DeepGemmMoE()
    raise ConfigError(f"unknown MoE backend {kind}")


def make_backends(attention: str = "torch", linear: str = "torch", moe: str = "torch", fusions: str = "off"
                  ) -> Backends:
    try:
        # The GPU attention backends imply a GPU (or the Triton interpreter): fuse the norms there too.
        return Backends(make_attention(attention), make_linear(linear), make_moe(moe),
                        fused_norm=AttentionBackend(attention) != AttentionBackend.TORCH,
                        fusions=parse_fusions(fusions))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def default_moe_backend(gpu: bool, fp8: bool, whole_experts: bool, deepgemm_missing: str | None) -> tuple[str, str]:
    """The MoE backend when none is asked for, and why. Policy only; `auto_moe_backend` probes.

    DeepGEMM where it can run: its grouped GEMMs took a 20b prefill on one H200 from 122 to 103 ms at
    8k tokens and 46.6 to 42.0 ms at 2k (run DG7), and decode-sized batches go to the Triton MoE
    inside it (same step time)."""
    if not gpu:
        return "torch", "CPU"
    if not fp8:
        return "triton", "bf16 experts (the DeepGEMM path is FP8 only)"
    if not whole_experts:
        return "triton", "experts sharded by TP (DeepGEMM runs whole experts: tp 1 or --moe-mode ep)"
    if deepgemm_missing:
        return "triton", f"DeepGEMM unavailable: {deepgemm_missing}"
    return "deepgemm", "FP8 experts on Hopper with DeepGEMM (prefill-sized batches; smaller ones Triton)"


def auto_moe_backend(device: str, fp8: bool, whole_experts: bool) -> str:
    """default_moe_backend with DeepGEMM probed on `device` where it could be chosen; logs the choice."""
    gpu = device.startswith("cuda")
    missing = None
    if gpu and fp8 and whole_experts:
        import torch

        from kernels import deepgemm_sm90 as dg
        from kernels.moe_dg import DOWN, GATE_UP
        missing = dg.unavailable_reason([GATE_UP, DOWN], torch.device(device))
    name, why = default_moe_backend(gpu, fp8, whole_experts, missing)
    log.info("MoE backend %s (default: %s)", name, why)
    return name
