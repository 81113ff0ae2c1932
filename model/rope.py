"""YaRN rotary embedding (arXiv 2309.00071) as gpt-oss uses it: NeoX half-split, applied to q and k
before they enter the KV cache. inv_freq blends interpolated (f/S) and extrapolated (f) frequencies
with a linear ramp between the correction bounds; the concentration m = 0.1 ln S + 1 multiplies
both cos and sin (so logits carry m^2). Matches HF `_compute_yarn_parameters` and the OpenAI
reference `_compute_concentration_and_inv_freq`.
"""

from __future__ import annotations

import math

import torch

from model.config import GptOssConfig, yarn_bounds


def yarn_inv_freq(cfg: GptOssConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [D/2] fp32, concentration)."""
    rope, d = cfg.rope, cfg.head_dim
    extrap = 1.0 / (rope.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if rope.rope_type != "yarn" or rope.factor <= 1.0:
        return extrap, 1.0
    interp = extrap / rope.factor
    low, high = yarn_bounds(rope, d)
    if low == high:
        high += 0.001  # HF: prevent a singular ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    inv_freq = interp * ramp + extrap * (1 - ramp)
    return inv_freq, 0.1 * math.log(rope.factor) + 1.0


class Rotary:
    """cos/sin for arbitrary absolute positions, computed on the fly in fp32 (exactly HF's ops)."""

    def __init__(self, cfg: GptOssConfig, device: torch.device | str = "cpu") -> None:
        inv_freq, self.concentration = yarn_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D/2] fp32 (concentration included)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.concentration, freqs.sin() * self.concentration
