"""Fill a `GptOss` from a `TensorSource`: validate names and shapes, slice this rank's shard, convert.

Source formats (config.json `quantization_config.quant_method`):
  * "mxfp4": the HF hub layout. Experts dequantise exactly (MXFP4 values are exact in fp32/bf16) and,
    in FP8 mode, re-quantise per rank with power-of-two 128x128 tile scales, exact for tiles whose
    exponent spread allows it (MODEL_SPEC.md §1.4). Slicing happens before quantisation, so any
    TP shard works, even ones that cut 32-wide MXFP4 blocks or 128-wide tiles.
  * "none": bf16 experts in HF's in-memory [E, in, out] layout.
  * "fp8": written by `tandem convert` (names in `model.convert`); dequantised exactly, then sliced
    and re-quantised, which reproduces the stored tiles bit for bit when shards are tile-aligned.
Everything is moved to the model's device tensor by tensor, so peak host memory is one tensor.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from tqdm import tqdm

from common.errors import CheckpointError, ConfigError
from kernels.reference import dequantize_fp8_blockwise, quantize_fp8_blockwise
from model.config import GptOssConfig
from model.gpt_oss import GptOss
from model.kv_scales import scales_from_checkpoint
from model.quant import Fp8ConversionStats, dequantize_mxfp4, quantize_fp8_pow2
from model.weights import TensorSource, expected_tensors

log = logging.getLogger("tandem.loader")

FP8_SCALE_SUFFIX = "_scale_inv"


def fp8_names(cfg: GptOssConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Tensor names of a `tandem convert` FP8 checkpoint."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    exp_cfg = expected_tensors(dataclasses.replace(cfg, quant_method="none"))
    for name, (shape, dtype) in exp_cfg.items():
        if name.endswith("_proj.weight") and ".self_attn." in name:
            out[name] = (shape, torch.float8_e4m3fn)
            out[name + FP8_SCALE_SUFFIX] = ((-(-shape[0] // 128), -(-shape[1] // 128)), torch.float32)
        elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            e, k, n = shape  # stored out x in: [E, N, K]
            out[name + ".weight"] = ((e, n, k), torch.float8_e4m3fn)
            out[name + ".weight" + FP8_SCALE_SUFFIX] = ((e, -(-n // 128), -(-k // 128)), torch.float32)
        else:
            out[name] = (shape, dtype)
    return out


def validate_source(src: TensorSource) -> None:
    cfg = src.config
    want = fp8_names(cfg) if cfg.quant_method == "fp8" else expected_tensors(cfg)
    have = set(src.names())
    missing = [n for n in want if n not in have]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")
    for name, (shape, _) in want.items():
        got = tuple(src.shape(name))
        if got != shape:
            raise CheckpointError(f"tensor {name} has shape {got}, config implies {shape}")


class _Reader:
    def __init__(self, src: TensorSource, device: torch.device) -> None:
        self.src, self.dev, self.fp8_src = src, device, src.config.quant_method == "fp8"

    def dense(self, name: str, rows: range | None = None) -> torch.Tensor:
        """A 2-D/1-D weight in fp32 (exact dequantisation of FP8 sources), rows optionally sliced."""
        if self.fp8_src and name.endswith("_proj.weight") and ".self_attn." in name:
            w = dequantize_fp8_blockwise(self.src.get(name, self.dev), self.src.get(name + FP8_SCALE_SUFFIX, self.dev))
            return w if rows is None else w[rows.start:rows.stop]
        if rows is None:
            return self.src.get(name, self.dev).float()
        return self.src.get_rows(name, rows.start, rows.stop, self.dev).float()

    def mxfp4(self, prefix: str, proj: str, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
        """The MXFP4 source's [El, out, in/32, 16] u8 blocks and [El, out, in/32] u8 exponents, as stored."""
        e0, e1 = experts.start, experts.stop
        return (self.src.get_rows(f"{prefix}{proj}_blocks", e0, e1, self.dev),
                self.src.get_rows(f"{prefix}{proj}_scales", e0, e1, self.dev))

    def experts(self, prefix: str, proj: str, experts: range,
                keep: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """[El, out, in] fp32 for experts in range (values exactly as stored). keep: MXFP4 buffers [El, ...] the
        source's blocks and exponents are also copied into (an MXFP4 source only)."""
        cfg = self.src.config
        e0, e1 = experts.start, experts.stop
        if cfg.quant_method == "mxfp4":
            blocks, scales = self.mxfp4(prefix, proj, experts)
            if keep is not None:
                keep[0].copy_(blocks)
                keep[1].copy_(scales)
            return dequantize_mxfp4(blocks, scales, torch.float32)
        if cfg.quant_method == "fp8":
            q = self.src.get_rows(f"{prefix}{proj}.weight", e0, e1, self.dev)
            s = self.src.get_rows(f"{prefix}{proj}.weight{FP8_SCALE_SUFFIX}", e0, e1, self.dev)
            return dequantize_fp8_blockwise(q, s)
        return self.src.get_rows(f"{prefix}{proj}", e0, e1, self.dev).float().transpose(1, 2)


def _copy(param: torch.nn.Parameter | None, value: torch.Tensor) -> None:
    if param is None:
        return
    if tuple(param.shape) != tuple(value.shape):
        raise CheckpointError(f"internal shard shape {tuple(value.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(value.to(param.dtype))


def _linear(w_param, s_param, w: torch.Tensor) -> None:
    if s_param is None:
        _copy(w_param, w)
        return
    q, s = quantize_fp8_blockwise(w)  # bf16 attention weights: amax / 448 per 128x128 tile
    _copy(w_param, q)
    _copy(s_param, s)


def mxfp4_expert_bytes(cfg, num_local: int) -> int:
    """Device bytes of `num_local` experts a layer kept in MXFP4 over all layers: half a byte a weight and one
    exponent byte per 32 (20b: 10.15 GB for its 32 experts)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    weights = 2 * i * h + h * i
    return cfg.num_hidden_layers * num_local * (weights // 2 + weights // 32)


def _keeps_mxfp4(src: TensorSource, model: GptOss, e_rng: range, i_rng: range) -> bool:
    """Whether the checkpoint's MXFP4 experts can be kept beside the compute copy (EngineConfig.mxfp4_experts):
    an MXFP4 source and whole experts (TP slices of the intermediate dim would cut 32-input exponent groups). On a
    GPU without room for them (120b's 61 GB beside its FP8 experts on one H200) it is a ConfigError before any copy,
    not an out-of-memory error mid-load."""
    why = ("the checkpoint's experts are not MXFP4" if src.config.quant_method != "mxfp4" else
           "experts are sliced by TP (--moe-mode ep or tp 1 keep them whole)"
           if len(i_rng) != model.cfg.intermediate_size else "")
    if why:
        log.warning("MXFP4 experts not kept: %s; Fusion.MXFP4_MOE will not apply", why)
        return False
    need = mxfp4_expert_bytes(model.cfg, len(e_rng))
    if model.device.type == "cuda":
        free = torch.cuda.mem_get_info(model.device)[0]
        if need > free:
            raise ConfigError(f"--mxfp4-experts needs {need / 2**30:.1f} GiB more on {model.device}, "
                              f"{free / 2**30:.1f} GiB are free after the model's own weights")
    log.info("keeping the MXFP4 experts too: %.1f GiB", need / 2**30)
    return True


def _mxfp4_buffers(model: GptOss, m, e_rng: range):
    """Empty MXFP4 experts [El, ...] for one MoE layer (its biases shared with the compute copy)."""
    from kernels.moe_mxfp4 import Mxfp4Experts

    cfg, dev, el = model.cfg, model.device, len(e_rng)
    h, i = cfg.hidden_size, cfg.intermediate_size

    def buf(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, device=dev)

    return Mxfp4Experts.from_blocks(buf(el, 2 * i, h // 32, 16), buf(el, 2 * i, h // 32), m.b1,
                                    buf(el, h, i // 32, 16), buf(el, h, i // 32), m.b2, expert_start=e_rng.start,
                                    alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


def load_weights(model: GptOss, src: TensorSource, *, progress: bool = True,
                 expert_chunk: int = 8, keep_mxfp4: bool = False) -> Fp8ConversionStats:
    """Returns the FP8 conversion statistics of the expert weights (empty when not FP8). FP8 KV scales
    the checkpoint carries (vLLM's names) land in `model.checkpoint_kv_scales` (None when absent).
    keep_mxfp4: also keep the checkpoint's MXFP4 experts as stored (`MoE.keep_mxfp4`, for Fusion.MXFP4_MOE), where
    `_keeps_mxfp4` allows."""
    validate_source(src)
    cfg, par, dev = model.cfg, model.par, model.device
    if src.config.num_hidden_layers != cfg.num_hidden_layers or src.config.hidden_size != cfg.hidden_size:
        raise CheckpointError("checkpoint config does not match the model being loaded")
    rd = _Reader(src, dev)
    stats = Fp8ConversionStats()
    d = cfg.head_dim
    qh, kvh = par.q_heads(cfg), par.kv_heads(cfg)
    q_rows, kv_rows = range(qh.start * d, qh.stop * d), range(kvh.start * d, kvh.stop * d)
    e_rng, i_rng = par.experts(cfg), par.intermediate(cfg)
    keep_mxfp4 = keep_mxfp4 and _keeps_mxfp4(src, model, e_rng, i_rng)

    model.checkpoint_kv_scales = scales_from_checkpoint(set(src.names()), lambda n: src.get(n, "cpu"),
                                                        cfg.num_hidden_layers, cfg.num_key_value_heads)
    _copy(model.embed, rd.dense("model.embed_tokens.weight"))
    _copy(model.lm_head, rd.dense("lm_head.weight", par.vocab_rows(cfg)))
    _copy(model.norm, rd.dense("model.norm.weight"))
    layers = tqdm(range(cfg.num_hidden_layers), desc="loading layers", disable=not progress, unit="layer")
    for n in layers:
        p, blk = f"model.layers.{n}.", model.layers[n]
        a = blk.attn
        _copy(blk.attn_norm, rd.dense(p + "input_layernorm.weight"))
        _copy(blk.mlp_norm, rd.dense(p + "post_attention_layernorm.weight"))
        qkv = torch.cat([rd.dense(p + "self_attn.q_proj.weight", q_rows), rd.dense(p + "self_attn.k_proj.weight", kv_rows),
                         rd.dense(p + "self_attn.v_proj.weight", kv_rows)])
        _linear(a.qkv_w, a.qkv_s, qkv)
        _copy(a.qkv_b, torch.cat([rd.dense(p + "self_attn.q_proj.bias", q_rows), rd.dense(p + "self_attn.k_proj.bias", kv_rows),
                                  rd.dense(p + "self_attn.v_proj.bias", kv_rows)]))
        _linear(a.o_w, a.o_s, rd.dense(p + "self_attn.o_proj.weight")[:, q_rows.start:q_rows.stop])
        _copy(a.o_b, rd.dense(p + "self_attn.o_proj.bias"))
        _copy(a.sinks, rd.dense(p + "self_attn.sinks")[qh.start:qh.stop])
        m = blk.mlp
        _copy(m.router_w, rd.dense(p + "mlp.router.weight"))
        _copy(m.router_b, rd.dense(p + "mlp.router.bias"))
        b1 = rd.dense(p + "mlp.experts.gate_up_proj_bias", e_rng)  # [El, 2I] interleaved
        _copy(m.b1, b1[:, 2 * i_rng.start:2 * i_rng.stop])
        if m.b2 is not None:
            _copy(m.b2, rd.dense(p + "mlp.experts.down_proj_bias", e_rng))
        mx = _mxfp4_buffers(model, m, e_rng) if keep_mxfp4 else None
        if mx is not None:
            m.keep_mxfp4(mx)
        for c0 in range(e_rng.start, e_rng.stop, expert_chunk):
            chunk = range(c0, min(c0 + expert_chunk, e_rng.stop))
            lo, hi = c0 - e_rng.start, chunk.stop - e_rng.start
            keep1 = (mx.w1.view(*mx.w1_exp.shape, 16)[lo:hi], mx.w1_exp[lo:hi]) if mx is not None else None
            keep2 = (mx.w2.view(*mx.w2_exp.shape, 16)[lo:hi], mx.w2_exp[lo:hi]) if mx is not None else None
            # Gate/up rows are interleaved (2i = gate_i, 2i+1 = up_i): slicing whole pairs keeps them together.
            w1 = rd.experts(p + "mlp.experts.", "gate_up_proj", chunk, keep1)[:, 2 * i_rng.start:2 * i_rng.stop]
            w2 = rd.experts(p + "mlp.experts.", "down_proj", chunk, keep2)[:, :, i_rng.start:i_rng.stop]
            for w, wp, sp in ((w1, m.w1, m.w1_s), (w2, m.w2, m.w2_s)):
                if sp is None:
                    wp.data[lo:hi].copy_(w.to(wp.dtype))
                else:
                    q, s, st = quantize_fp8_pow2(w)
                    wp.data[lo:hi].copy_(q)
                    sp.data[lo:hi].copy_(s)
                    stats.add(st)
    return stats
