"""Scales of an FP8 (e4m3) KV cache: one fp32 scale per layer and KV head, for K and for V.

Convention (vLLM's): a cached value is q = RTNE(clamp(x / scale, +-448)) in e4m3 and reads back as
q * scale. K is quantised after RoPE (what attention reads). The kernels fold the scale into the
QK product (K) and into the softmax weights (V) of a (layer, KV head) program, so reading costs one
multiply per tile; the store kernel divides exactly (div_rn), like the reference.

Where the scales come from, first match wins:
  * the checkpoint, under the names vLLM loads (`CHECKPOINT_NAMES`): a scalar per layer (what
    vLLM/ModelOpt/compressed-tensors write) or one per KV head. OpenAI's gpt-oss checkpoints carry
    none, nor do ours.
  * start-up calibration (`--kv-scale-calibration N`, engine/kv_calibration.py): amax of K and V
    per layer and KV head over N prompts -> `from_amax` (a power of two with >= 2x headroom).
  * the default, 1.0 everywhere. Why: e4m3's relative precision (3 mantissa bits) is the same for
    every magnitude in its normal range [2^-6, 448], so a scale only moves that window: overflow
    (clipping) above 448 * s, subnormals (lost precision) below 2^-6 * s. With s = 1 the window is
    [0.0156, 448]; gpt-oss K after RoPE and V, measured on the tiny and on real-dims random models
    (benchmarks/parity_real.py --kv-amax; README), stay far inside it, and 1.0 is what vLLM uses when
    a checkpoint has no scales -- the setting under which vLLM serves gpt-oss with
    kv_cache_dtype=fp8 at unchanged GPQA/AIME. A power of two also keeps dequantisation exact in bf16.

Both sides of a KV transfer must use the same table: `tag` names it in the KV handshake
(kv_transfer.messages.KVCompat), so a peer with other scales is refused with a clear error. Tables
are global ([layers, all KV heads]); a TP rank uses its head slice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from common.errors import CheckpointError

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CALIBRATION_HEADROOM = 2.0  # calibrated scales leave amax at <= 448 / 2: unseen prompts may go higher

# Per-layer names vLLM maps onto its attention's k_scale / v_scale (weight_utils.maybe_remap_kv_scale_name):
# plain, ModelOpt, compressed-tensors (output_scale of the projections) and the deprecated shared kv_scale.
CHECKPOINT_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.attn.k_scale", "self_attn.k_proj.k_scale",
          "self_attn.k_proj.output_scale", "self_attn.kv_scale"),
    "v": ("self_attn.v_scale", "self_attn.attn.v_scale", "self_attn.v_proj.v_scale",
          "self_attn.v_proj.output_scale", "self_attn.kv_scale"),
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE


@dataclass(frozen=True)
class KVScales:
    """k, v: [layers, total KV heads] fp32 on the host; source: default | checkpoint | calibrated:N."""

    k: torch.Tensor
    v: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        assert self.k.shape == self.v.shape and self.k.dim() == 2, "k/v scales must be [layers, kv_heads]"
        bad = ~(torch.isfinite(self.k) & torch.isfinite(self.v) & (self.k > 0) & (self.v > 0))
        if bad.any():
            layer, head = (int(i) for i in torch.nonzero(bad)[0])
            raise CheckpointError(f"KV scale of layer {layer} head {head} is not a positive finite number")

    @classmethod
    def default(cls, num_layers: int, num_kv_heads: int) -> KVScales:
        ones = torch.ones(num_layers, num_kv_heads, dtype=torch.float32)
        return cls(ones, ones.clone(), "default")

    @classmethod
    def from_amax(cls, k_amax: torch.Tensor, v_amax: torch.Tensor, source: str) -> KVScales:
        """Measured |K|, |V| maxima [layers, heads] -> power-of-two scales with amax * headroom
        <= 448 * scale. Heads never seen (amax 0) keep 1.0."""
        def pow2(amax: torch.Tensor) -> torch.Tensor:
            need = amax.double() * CALIBRATION_HEADROOM / FP8_MAX
            e = torch.ceil(torch.log2(need.clamp(min=2.0 ** -60)))
            return torch.where(amax > 0, torch.exp2(e), torch.ones_like(e)).float()
        return cls(pow2(k_amax), pow2(v_amax), source)

    @property
    def tag(self) -> str:
        """What the KV handshake compares: the source and a digest of the values ("default" is 1.0
        everywhere, whatever the shape of the table a rank built)."""
        if self.source == "default":
            return "default"
        h = hashlib.sha256(self.k.contiguous().numpy().tobytes() + self.v.contiguous().numpy().tobytes())
        return f"{self.source}:{h.hexdigest()[:16]}"

    def heads(self, kv_heads: range) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's columns: ([layers, Hkv_local], [layers, Hkv_local])."""
        return self.k[:, kv_heads.start:kv_heads.stop], self.v[:, kv_heads.start:kv_heads.stop]

    def describe(self) -> str:
        def rng(t: torch.Tensor) -> str:
            lo, hi = float(t.min()), float(t.max())
            return f"{lo:g}" if lo == hi else f"{lo:g}..{hi:g}"
        return f"{self.source} (K {rng(self.k)}, V {rng(self.v)})"


def scales_from_checkpoint(names: set[str], get, num_layers: int, num_kv_heads: int) -> KVScales | None:
    """K/V scales stored in a checkpoint, or None when it has none. `get(name)` -> tensor. Every layer
    must have both or the checkpoint is refused (a half-scaled cache would be silently wrong)."""
    found = {kind: [next((f"model.layers.{n}.{s}" for s in suffixes if f"model.layers.{n}.{s}" in names), None)
                    for n in range(num_layers)] for kind, suffixes in CHECKPOINT_NAMES.items()}
    have = [x is not None for kind in found for x in found[kind]]
    if not any(have):
        return None
    if not all(have):
        missing = [f"layer {n} {kind}" for kind in found for n, x in enumerate(found[kind]) if x is None]
        raise CheckpointError(f"checkpoint has KV scales for some layers only; missing {missing[:4]}")
    out = {}
    for kind, per_layer in found.items():
        rows = []
        for name in per_layer:
            t = get(name).float().reshape(-1)
            if t.numel() not in (1, num_kv_heads):
                raise CheckpointError(f"{name} has {t.numel()} values; expected 1 or {num_kv_heads} (one per KV head)")
            rows.append(t.expand(num_kv_heads).clone())
        out[kind] = torch.stack(rows)
    return KVScales(out["k"], out["v"], "checkpoint")


def amax_of_pages(cache: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """max |x| per KV head over the given pages of one layer's K or V cache [NP, Hkv, P, D] -> [Hkv]."""
    if not pages:
        return torch.zeros(cache.shape[1])
    sel = cache[torch.tensor(pages, dtype=torch.long, device=cache.device)].float().abs()  # [n, Hkv, P, D]
    return sel.amax(dim=(0, 2, 3)).cpu()

