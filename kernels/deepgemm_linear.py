"""Dense FP8 linear with bias on DeepGEMM's SM90 kernel (LinearImpl "deepgemm").

DeepGEMM's 128x128-scale kernel has no bias input and no epilogue hook for one, and a separate add
is one more pass over the output (~10 % of a prefill QKV GEMM). So the bias rides in the GEMM:
one extra K block whose activation columns hold the constant 1 and whose weight rows hold the bias,
split into three e4m3 terms (hi + mid + lo, one 128x128 scale per 128 outputs) so their fp32 sum
carries the bias to ~2^-12 relative, finer than the bf16 output. K = 2880 becomes 2947 (23 -> 24
K blocks, +4 % MMA work); the unused columns are TMA zero fill, not memory.

    x [M, K] --quantise 1x128, ones at column KB0*128--> a [M, KB0*128 + 3]   (KB0 = ceil(K/128))
    w [N, K], b [N] ----------------------------------->  w_aug [N, KB0*128 + 3] (built once)
    y = a w_aug^T = x w^T + b

The augmented weight is a second copy of each dense weight (~0.6 GB for 20b), built on first use.
M <= 64 takes a 64-row tile. GPU-only (SM90); see kernels/deepgemm_sm90.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import deepgemm_sm90 as dg
from kernels.fp8_gemm import _DerivedCache, _flatten
from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128
from kernels.reference import BLOCK, FP8_MAX

BIAS_TERMS = 3
ROW_ALIGN = 16  # TMA: row strides in multiples of 16 bytes

# Tiles measured on the H200 at M = 8192 (run DG1): (N, K blocks incl. bias) -> config.
TILES: dict[tuple[int, int], dg.DgConfig] = {
    (5120, 24): dg.DgConfig(256, 128, mcast=2, mcast_on_a=True),  # QKV: 1,117 TFLOP/s without bias
}
LARGE_DEFAULT = dg.DgConfig(128, 192, mcast=2)  # O 2880 x 4096: 1,297 TFLOP/s
SMALL = dg.DgConfig(64, 128)


def split_bias_fp8(b: torch.Tensor, terms: int = BIAS_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """b [N] -> (q e4m3 [N, terms], scale fp32 [ceil(N/128)]) with sum_j q[:, j] * scale ~= b.

    One scale per 128 outputs (a 128x128 weight block's scale): max|b| / 448 of the block. Each term
    quantises what the previous ones left over, on the same scale, so the error shrinks ~16x per term
    down to the e4m3 subnormal floor (2^-9 of the scale)."""
    n = b.shape[0]
    nb = -(-n // BLOCK)
    bf = torch.zeros(nb * BLOCK, dtype=torch.float32, device=b.device)
    bf[:n] = b.float()
    blocks = bf.view(nb, BLOCK)
    scale = (blocks.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-30)  # [NB]
    rest = blocks / scale[:, None]
    parts = []
    for _ in range(terms):
        q = rest.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        parts.append(q)
        rest = rest - q.float()
    return torch.stack(parts, dim=-1).view(nb * BLOCK, terms)[:n], scale


def augment_weight(w: torch.Tensor, ws: torch.Tensor, b: torch.Tensor | None, row_align: int = ROW_ALIGN
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, K] e4m3, ws [NB, KB0], b [N]) -> (w_aug [N, K'] e4m3, rows padded to `row_align`
    bytes, ws_aug [NB, KB']) where K' = KB0*128 + 3 holds the bias terms (b None: K' = K)."""
    n, k = w.shape
    kb0 = -(-k // BLOCK)
    k_aug = kb0 * BLOCK + BIAS_TERMS if b is not None else k
    stride = -(-k_aug // row_align) * row_align
    buf = torch.zeros(n, stride, dtype=w.dtype, device=w.device)
    buf[:, :k] = w
    ws_aug = ws.float().contiguous()
    if b is not None:
        q, s = split_bias_fp8(b)
        buf[:, kb0 * BLOCK: k_aug] = q
        ws_aug = torch.cat([ws_aug, s[:, None]], dim=1).contiguous()  # [NB, KB0 + 1]
    return buf[:, :k_aug], ws_aug


def augment_activations(x: torch.Tensor, w_aug: torch.Tensor, has_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (a e4m3 [M, K'] with w_aug's row stride, scales [M, KB'] M-major, M_al % 4 == 0):
    the activation side of `augment_weight`, with the constant-1 columns when it holds a bias."""
    k = x.shape[1]
    ones = (-(-k // BLOCK) * BLOCK, BIAS_TERMS) if has_bias else None
    xq, xs = quantize_act_1x128(x, k_pad=w_aug.stride(0), m_align=4, ones=ones)
    return xq[:, : w_aug.shape[1]], xs


class DeepGemmLinear:
    name = "deepgemm"

    def __init__(self, row_align: int = ROW_ALIGN) -> None:
        self._aug = _DerivedCache()
        self.row_align = row_align

    def config_for(self, m: int, n: int, kb: int) -> dg.DgConfig:
        if m <= 64:
            return SMALL
        return TILES.get((n, kb), LARGE_DEFAULT)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if w_scale is None:
            return F.linear(x, w, bias)
        x2, lead = _flatten(x)
        m, n = x2.shape[0], w.shape[0]
        w_aug, ws_aug = self._aug.get(w, ("aug", bias is not None and bias.data_ptr()),
                                      lambda: augment_weight(w, w_scale, bias, self.row_align))
        a, xs = augment_activations(x2, w_aug, bias is not None)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        dg.gemm(self.config_for(m, n, ws_aug.shape[1]), a, xs, w_aug, ws_aug, y)
        return y.to(x.dtype).reshape(*lead, n)
