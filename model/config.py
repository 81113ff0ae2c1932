"""GptOssConfig: the model's shape and quirks, read from an HF `config.json`.

Accepts both spellings HF has used: the hub's legacy `rope_scaling` + top-level `rope_theta`, and
transformers v5's `rope_parameters` (with `rope_theta` inside). `truncate` defaults to True in HF
when absent, which floors/ceils the YaRN ramp bounds and changes inv_freq by up to 76 %; the real
checkpoints say `"truncate": false` and we honour whatever the file says (MODEL_SPEC.md §2).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 150000.0
    rope_type: str = "yarn"  # "yarn" or "default"
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 4096
    truncate: bool = False


@dataclass(frozen=True, slots=True)
class GptOssConfig:
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    layer_types: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = (200002, 199999, 200012)
    pad_token_id: int = 199999
    quant_method: str = "mxfp4"  # of the checkpoint on disk: "mxfp4", "fp8" or "none"

    def __post_init__(self) -> None:
        if not self.layer_types:
            # Layer l is sliding when l is even (reference: `sliding_window if layer_idx % 2 == 0`).
            types = tuple(SLIDING if i % 2 == 0 else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        self.validate()

    # ---- derived -----------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"invalid gpt-oss config: {msg}")

        need(self.num_hidden_layers > 0, "num_hidden_layers must be > 0")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        need(not bad, f"unknown layer_types {bad}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.head_dim % 2 == 0, "head_dim must be even (NeoX RoPE halves)")
        need(0 < self.num_experts_per_tok <= self.num_local_experts,
             "num_experts_per_tok must be in [1, num_local_experts]")
        # MXFP4 packs 32 input-dim elements per block: both expert matmuls need K % 32 == 0.
        need(self.hidden_size % 32 == 0 and self.intermediate_size % 32 == 0,
             "hidden_size and intermediate_size must be multiples of 32 (MXFP4 blocks)")
        need(self.sliding_window > 0, "sliding_window must be > 0")
        need(self.rope.rope_type in ("yarn", "default"), f"unsupported rope_type {self.rope.rope_type!r}")
        need(self.quant_method in ("mxfp4", "fp8", "none"), f"unknown quant_method {self.quant_method!r}")
        need(not self.tie_word_embeddings, "gpt-oss has an untied unembedding")

    # ---- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> GptOssConfig:
        mt = d.get("model_type", "gpt_oss")
        if mt != "gpt_oss":
            raise ConfigError(f"model_type is {mt!r}, expected 'gpt_oss'")
        rope_d = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rope_d.get("rope_theta", d.get("rope_theta", 150000.0))
        rope_type = rope_d.get("rope_type", rope_d.get("type", "default"))
        rope = RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(rope_d.get("factor", 1.0)),
            beta_fast=float(rope_d.get("beta_fast", 32.0)),
            beta_slow=float(rope_d.get("beta_slow", 1.0)),
            original_max_position_embeddings=int(
                rope_d.get("original_max_position_embeddings", d.get("initial_context_length", 4096))),
            # HF's default when the key is absent is True (floor/ceil); keep that meaning.
            truncate=bool(rope_d.get("truncate", True)),
        )
        eos = d.get("eos_token_id", 200002)
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        qc = d.get("quantization_config") or {}
        quant = qc.get("quant_method", "none") if qc else "none"
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                num_key_value_heads=int(d["num_key_value_heads"]),
                head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
                num_local_experts=int(d["num_local_experts"]),
                num_experts_per_tok=int(d.get("num_experts_per_tok", d.get("experts_per_token", 4))),
                sliding_window=int(d.get("sliding_window") or 128),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
                swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
                attention_bias=bool(d.get("attention_bias", True)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope=rope,
                layer_types=tuple(d.get("layer_types") or ()),
                eos_token_ids=eos_ids,
                pad_token_id=int(d.get("pad_token_id") or 199999),
                quant_method=quant,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required key {e.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> GptOssConfig:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.exists():
            raise ConfigError(f"no config.json at {p}")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        cfg = cls.from_hf_dict(d)
        gen = p.parent / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
                cfg = dataclasses.replace(cfg, eos_token_ids=ids)
        return cfg

    def to_hf_dict(self) -> dict[str, Any]:
        """The hub's config.json spelling (legacy `rope_scaling` + top-level `rope_theta`)."""
        d: dict[str, Any] = {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "eos_token_id": self.eos_token_ids[0],
            "experts_per_token": self.num_experts_per_tok,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initial_context_length": self.rope.original_max_position_embeddings,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_local_experts": self.num_local_experts,
            "output_router_logits": False,
            "pad_token_id": self.pad_token_id,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "sliding_window": self.sliding_window,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }
        if self.rope.rope_type == "yarn":
            d["rope_scaling"] = {
                "rope_type": "yarn",
                "factor": self.rope.factor,
                "beta_fast": self.rope.beta_fast,
                "beta_slow": self.rope.beta_slow,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                "truncate": self.rope.truncate,
            }
        if self.quant_method == "mxfp4":
            d["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
            }
        elif self.quant_method == "fp8":
            d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        return d

    # ---- counts ------------------------------------------------------------------------------
    def num_params(self) -> int:
        h, i, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        attn = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size) \
            + self.q_size * h + h + self.num_attention_heads
        moe = e * h + e + e * (2 * i * h + 2 * i + i * h + h)
        per_layer = attn + moe + 2 * h
        return self.num_hidden_layers * per_layer + 2 * self.vocab_size * h + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K+V for one token across all layers, all KV heads (full, unbounded view)."""
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes



PRESETS: dict[str, GptOssConfig] = {
    "gpt-oss-20b": GptOssConfig(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": GptOssConfig(num_hidden_layers=36, num_local_experts=128),
    # The embedded default: real vocabulary (so Harmony tokens are valid ids), real window and
    # layer alternation, tiny widths. Runs the whole service on a CPU.
    "tiny": GptOssConfig(vocab_size=201088, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                         num_experts_per_tok=4),
    # The embedded demo model (model/demo, trained by training/): the same architecture and layout,
    # fewer and wider experts so a CPU can train it in minutes.
    "tiny-demo": GptOssConfig(vocab_size=201088, hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                              num_experts_per_tok=2),
    # Numerics on a CPU (benchmarks/prefix_agreement.py): the real vocabulary, head_dim, GQA ratio (8),
    # window and layer alternation, so logit magnitudes and attention spans are realistic; small widths.
    "tiny-wide": GptOssConfig(vocab_size=201088, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=16, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                              num_experts_per_tok=4),
    # Parity configs: small vocab and windows shorter than the test sequences.
    "tiny-a": GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                           num_experts_per_tok=2, sliding_window=4, max_position_embeddings=4096,
                           eos_token_ids=(510,), pad_token_id=511),
    "tiny-b": GptOssConfig(vocab_size=384, hidden_size=96, intermediate_size=64, num_hidden_layers=5,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_local_experts=6,
                           num_experts_per_tok=3, sliding_window=7, max_position_embeddings=4096,
                           rope=RopeConfig(theta=10000.0, factor=8.0, original_max_position_embeddings=64),
                           eos_token_ids=(380,), pad_token_id=383),
    # Parallelism tests: 8 KV heads like the real models (TP up to 8), experts divisible by 4 and 8.
    "tiny-c": GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=8, num_local_experts=8,
                           num_experts_per_tok=4, sliding_window=6, max_position_embeddings=4096,
                           eos_token_ids=(510,), pad_token_id=511),
}


def preset(name: str) -> GptOssConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def yarn_bounds(rope: RopeConfig, head_dim: int) -> tuple[float, float]:
    """YaRN ramp bounds (low, high) in rotary-dimension-index space; floor/ceil only if truncate."""
    def dim_for(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)
