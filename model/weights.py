"""Checkpoint tensors in the HF layout (MODEL_SPEC.md §1.3), from disk or generated.

`TensorSource` is what the loader reads: a safetensors directory (lazy, one tensor at a time, so a
120b checkpoint never needs twice its size in RAM) or `RandomSource`, which generates the same
names, shapes and dtypes deterministically from a seed, on any device -- full-size random 20b/120b
weights are materialised straight into GPU memory this way, and `tandem make-checkpoint` saves a
RandomSource to disk for tests and the demo.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Protocol

import torch

from common.errors import CheckpointError
from model.config import GptOssConfig
from model.quant import quantize_mxfp4

EXPERT_PROJ = ("gate_up_proj", "down_proj")


def expected_tensors(cfg: GptOssConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of an HF gpt-oss checkpoint with cfg.quant_method ('mxfp4' or 'none')."""
    h, i, e, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.vocab_size
    q, kv, bf, f32, u8 = cfg.q_size, cfg.kv_size, torch.bfloat16, torch.float32, torch.uint8
    t: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "model.embed_tokens.weight": ((v, h), bf),
        "lm_head.weight": ((v, h), bf),
        "model.norm.weight": ((h,), f32),
    }
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = ((h,), f32)
        t[p + "post_attention_layernorm.weight"] = ((h,), f32)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[p + f"self_attn.{name}.weight"] = ((rows, h), bf)
            t[p + f"self_attn.{name}.bias"] = ((rows,), bf)
        t[p + "self_attn.o_proj.weight"] = ((h, q), bf)
        t[p + "self_attn.o_proj.bias"] = ((h,), bf)
        t[p + "self_attn.sinks"] = ((cfg.num_attention_heads,), bf)
        t[p + "mlp.router.weight"] = ((e, h), bf)
        t[p + "mlp.router.bias"] = ((e,), bf)
        t[p + "mlp.experts.gate_up_proj_bias"] = ((e, 2 * i), bf)
        t[p + "mlp.experts.down_proj_bias"] = ((e, h), bf)
        if cfg.quant_method == "mxfp4":
            t[p + "mlp.experts.gate_up_proj_blocks"] = ((e, 2 * i, h // 32, 16), u8)
            t[p + "mlp.experts.gate_up_proj_scales"] = ((e, 2 * i, h // 32), u8)
            t[p + "mlp.experts.down_proj_blocks"] = ((e, h, i // 32, 16), u8)
            t[p + "mlp.experts.down_proj_scales"] = ((e, h, i // 32), u8)
        else:  # HF's dequantised in-memory layout: [E, in, out]
            t[p + "mlp.experts.gate_up_proj"] = ((e, h, 2 * i), bf)
            t[p + "mlp.experts.down_proj"] = ((e, i, h), bf)
    return t


class TensorSource(Protocol):
    config: GptOssConfig

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def get_rows(self, name: str, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Slice [start:stop] of dim 0 without reading the rest where the format allows it."""
        ...


class SafetensorsSource:
    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        self.config = GptOssConfig.from_file(self.path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {self.path}")
            weight_map = {}
            for f in files:
                with safe_open(str(f), framework="pt") as fh:
                    weight_map.update({k: f.name for k in fh.keys()})
        self._map = weight_map
        self._handles: dict[str, object] = {}
        self._open = safe_open

    def _fh(self, name: str):
        if name not in self._map:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}")
        f = self._map[name]
        if f not in self._handles:
            file = self.path / f
            if not file.exists():
                raise CheckpointError(f"index names {f} but {file} does not exist")
            self._handles[f] = self._open(str(file), framework="pt")
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self._map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._fh(name).get_slice(name).get_shape())

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        return self._fh(name).get_tensor(name).to(device)

    def get_rows(self, name: str, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return self._fh(name).get_slice(name)[start:stop].to(device)


class RandomSource:
    """Deterministic random weights in the HF layout. Each tensor is seeded from (seed, name), so
    any subset can be generated in any order on any device and still match the saved files."""

    def __init__(self, cfg: GptOssConfig, seed: int = 0, fast_mxfp4: bool = False) -> None:
        self.config = cfg
        self.seed = seed
        # fast_mxfp4: random nibbles and exponents directly (for full-size benchmark weights: the
        # values do not matter for speed); otherwise Gaussian weights quantised to MXFP4.
        self.fast_mxfp4 = fast_mxfp4
        self._spec = expected_tensors(cfg)

    def names(self) -> list[str]:
        return list(self._spec)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._spec[name][0]

    def get_rows(self, name: str, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.get(name, device)[start:stop]

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        if name not in self._spec:
            raise CheckpointError(f"random checkpoint has no tensor {name!r}")
        shape, dtype = self._spec[name]
        cfg = self.config
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))

        def normal(shp: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
            return torch.randn(shp, generator=g, device=device) * std + mean

        if name.endswith("_blocks") or name.endswith("_scales"):
            return self._mxfp4(name, g, device)
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return normal(shape, 0.1, 1.0).to(dtype)
        if name == "model.embed_tokens.weight":
            return normal(shape, 1.0).to(dtype)
        if name == "lm_head.weight":
            # Well-separated logits keep greedy decoding stable against fp rounding noise.
            return normal(shape, 4.0 / cfg.hidden_size ** 0.5).to(dtype)
        if name.endswith("sinks"):
            return normal(shape, 1.0).to(dtype)
        if name.endswith("bias"):
            return normal(shape, 0.1).to(dtype)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            return normal(shape, shape[1] ** -0.5).to(dtype)  # [E, in, out]
        return normal(shape, shape[-1] ** -0.5).to(dtype)  # [out, in] linears

    def _mxfp4(self, name: str, g: torch.Generator, device: torch.device | str) -> torch.Tensor:
        base = name.rsplit("_", 1)[0]
        want_blocks = name.endswith("_blocks")
        shape_b = self._spec[base + "_blocks"][0]
        e, n, groups, _ = shape_b
        k = groups * 32
        if self.fast_mxfp4:
            if want_blocks:
                return torch.randint(0, 256, shape_b, generator=g, device=device, dtype=torch.uint8)
            # Nibble magnitudes average ~2.4: scale 2^(S-127) ~ 0.4/sqrt(K) keeps std ~ 1/sqrt(K).
            center = 127 + round(torch.log2(torch.tensor(0.4 / k ** 0.5)).item())
            return torch.randint(center - 1, center + 1, (e, n, groups), generator=g, device=device,
                                 dtype=torch.int32).to(torch.uint8)
        # Both halves come from the same Gaussian draw: seed by the base name.
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(base.encode())) % (2 ** 63))
        w = torch.randn((e, n, k), generator=g, device=device) * k ** -0.5
        blocks, scales = quantize_mxfp4(w)
        return blocks if want_blocks else scales
