"""Dense FP8 linear with bias on DeepGEMM's SM90 kernel (LinearImpl "deepgemm").

DeepGEMM's 128x128-scale kernel has no bias input and no epilogue hook for one, and a separate add
is one more pass over the output (~10 % of a prefill QKV GEMM). So the bias rides in the GEMM as
weight columns whose activation columns hold the constant 1, in one of two places:

  * "pad": K = 2880 (QKV) fills 22.5 K blocks, and the MMA computes the last block's 64 empty
    columns anyway. The bias goes there: no extra MMA work (23 K blocks). The constant must be
    exact, so that group's activation scale is a power of two (kernels/fp8_quant.py), and the bias
    must share the block's weight scale: it is split greedily into up to 64 e4m3 terms on that
    scale (raised by a power of two, with the 64 real weights' codes shifted exactly, when the bias
    is too large for the columns).
  * "block": K a multiple of 128 (O, K = 4096) or too little padding: one extra K block (+1/KB
    MMA work) with the bias as three terms (hi + mid + lo) on a scale of its own.

Either way the terms' fp32 sum carries the bias to ~2^-12 relative, finer than the bf16 output.

    x [M, K] --quantise 1x128, constant at columns ones--> a [M, K']
    w [N, K], b [N] -------------------------------------> w_aug [N, K'] (built once)
    y = a w_aug^T = x w^T + b

The augmented weight is a second copy of each dense weight (~0.6 GB for 20b), built on first use.
Each launcher has N and K' compiled in and a tile chosen by M range (`config_for`); the engine
builds them at start-up from the model's shapes (`launcher_configs`). GPU-only (SM90); see
kernels/deepgemm_sm90.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import deepgemm_sm90 as dg
from kernels.fp8_gemm import _DerivedCache, _flatten
from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128
from kernels.reference import BLOCK, FP8_MAX

BIAS_TERMS = 3  # "block" placement: hi + mid + lo
PAD_MIN_COLS = 8  # "pad" placement needs at least this many free columns in the last K block
ROW_ALIGN = 16  # TMA: row strides in multiples of 16 bytes
# "block" placement: K' = K + 3 would leave rows 16-byte aligned only (O: 4112 bytes), and every
# 128-byte TMA row read then straddles two lines: 1,148 -> 1,191 TFLOP/s at 128-byte rows (DG13).
BLOCK_ROW_ALIGN = 128

# Tiles measured on the H200 (runs DG1, DG6, DG13-DG15): (N, K blocks incl. bias, M from, M to) ->
# config, first match; otherwise SMALL up to SMALL_MAX_M rows, LARGE_DEFAULT above.
ANY_M = 1 << 30
TILES: dict[tuple[int, int, int, int], dg.DgConfig] = {
    (5120, 23, 129, ANY_M): dg.DgConfig(256, 128, mcast=2, mcast_on_a=True),  # QKV, bias in the padding: 1,279
    (5120, 24, 129, ANY_M): dg.DgConfig(256, 128, mcast=2, mcast_on_a=True),  # QKV, bias as an extra block
    # O + bias block (33 K blocks), decode sizes: 64-wide tiles give 45 CTAs instead of 23 (DG15:
    # 12.1-12.6 us vs 12.7-15.4 for 64x128 at M = 1..128, from bf16 activations)
    (2880, 33, 1, 128): dg.DgConfig(64, 64),
    # ... and at M = 8192: 1,214 vs 1,182 for 128x192, which loses 11 % to the 33rd block against
    # 3.5 % for 256x128 (cause not isolated). Below 4k rows 256-row tiles leave SMs idle (M = 1024:
    # 92 tiles for 132 SMs; 916 vs 1,090 TFLOP/s for 128x192 in DG14).
    (2880, 33, 4096, ANY_M): dg.DgConfig(256, 128, mcast=2, mcast_on_a=True),
}
LARGE_DEFAULT = dg.DgConfig(128, 192, mcast=2)  # O 2880 x 4096 without bias: 1,333 TFLOP/s (DG13)
# 64-row tiles up to 128 rows: at M = 128 QKV 13.8 vs 22.9 us (256x128), O 15.4 vs 23.3 (128x192), DG15
SMALL_MAX_M = 128
SMALL = dg.DgConfig(64, 128)


class AugWeight(NamedTuple):
    w: torch.Tensor  # e4m3 [N, K'], row stride a multiple of ROW_ALIGN bytes
    ws: torch.Tensor  # fp32 [NB, KB'] 128x128 scales
    ones: tuple[int, int] | None  # (first column, count) of the activation's constant-1 columns


def split_bias_fp8(b: torch.Tensor, terms: int = BIAS_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """b [N] -> (q e4m3 [N, terms], scale fp32 [ceil(N/128)]) with sum_j q[:, j] * scale ~= b.

    One scale per 128 outputs (a 128x128 weight block's scale): max|b| / 448 of the block. Each term
    quantises what the previous ones left over, on the same scale, so the error shrinks ~16x per term
    down to the e4m3 subnormal floor (2^-9 of the scale)."""
    scale = (_block_amax(b) / FP8_MAX).clamp(min=1e-30)  # [NB]
    return split_bias_on_scale(b, _per_row(scale, b.shape[0]), terms), scale


def _block_amax(b: torch.Tensor) -> torch.Tensor:
    """b [N] -> max|b| per 128 outputs [ceil(N/128)] (a 128x128 weight block's rows)."""
    nb = -(-b.shape[0] // BLOCK)
    return F.pad(b.float().abs(), (0, nb * BLOCK - b.shape[0])).view(nb, BLOCK).amax(dim=1)


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """[NB] per 128-row block -> [N] per row."""
    return t.repeat_interleave(BLOCK)[:n]


def split_bias_on_scale(b: torch.Tensor, scale: torch.Tensor, cols: int) -> torch.Tensor:
    """b [N], scale [N] -> q e4m3 [N, cols] with sum_j q[:, j] * scale ~= b: greedy, each column
    takes what the previous ones left (saturated at +-448 while the rest is large), down to the
    e4m3 subnormal step 2^-9 of the scale. Needs |b| / scale <= 448 * (cols - 3) for full precision."""
    rest = b.float() / scale
    parts = []
    for _ in range(cols):
        q = rest.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        parts.append(q)
        rest = rest - q.float()
    return torch.stack(parts, dim=-1)


def _bias_in_pad(w: torch.Tensor, ws: torch.Tensor, b: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """Writes b into buf's padding columns [K, KB0*128) of the last (partial) K block; returns the
    scales with that block's column raised by 2^s per 128 outputs where the bias needs it (the
    block's real weight codes are shifted by 2^-s to match: exact except codes that fall below
    e4m3's normal range)."""
    n, k = w.shape
    kl, cols = k // BLOCK, -(-k // BLOCK) * BLOCK - k
    ws = ws.float().clone()
    bmax = _block_amax(b)  # [NB]
    dead = ws[:, kl] <= 0  # a zero scale zeroes the block whatever its codes: give the bias a scale
    ws[:, kl] = torch.where(dead, (bmax / (FP8_MAX * (cols - BIAS_TERMS))).clamp(min=1e-30), ws[:, kl])
    need = bmax / (ws[:, kl] * FP8_MAX * (cols - BIAS_TERMS))
    shift = torch.where(need > 1, torch.ceil(torch.log2(need)), torch.zeros_like(need))  # [NB]
    if bool((shift > 0).any() or dead.any()):
        keep = torch.exp2(-_per_row(shift, n)) * ~_per_row(dead, n)  # [N]: 2^-s, 0 where the scale was 0
        codes = w[:, kl * BLOCK: k].float() * keep[:, None]
        buf[:, kl * BLOCK: k] = codes.to(w.dtype)
        ws[:, kl] = ws[:, kl] * torch.exp2(shift)
    buf[:, k: k + cols] = split_bias_on_scale(b, _per_row(ws[:, kl], n), cols)
    return ws


def placement(k: int, has_bias: bool, pad: bool = True, row_align: int = ROW_ALIGN
              ) -> tuple[str | None, int, int, tuple[int, int] | None]:
    """Where a [N, K] weight's bias goes -> (placement, K', row stride, constant-1 columns): the last
    K block's padding when it has >= PAD_MIN_COLS free columns and `pad`, else one extra K block;
    no bias: K' = K. Shapes only, so start-up can build the launchers before weights exist."""
    kb0 = -(-k // BLOCK)
    free = kb0 * BLOCK - k
    where = None if not has_bias else "pad" if pad and free >= PAD_MIN_COLS else "block"
    k_aug = {None: k, "pad": kb0 * BLOCK, "block": kb0 * BLOCK + BIAS_TERMS}[where]
    align = max(row_align, BLOCK_ROW_ALIGN) if where == "block" else row_align
    ones = {None: None, "pad": (k, free), "block": (kb0 * BLOCK, BIAS_TERMS)}[where]
    return where, k_aug, -(-k_aug // align) * align, ones


def augment_weight(w: torch.Tensor, ws: torch.Tensor, b: torch.Tensor | None, row_align: int = ROW_ALIGN,
                   pad: bool = True) -> AugWeight:
    """(w [N, K] e4m3, ws [NB, KB0], b [N]) -> AugWeight with the bias where `placement` puts it."""
    n, k = w.shape
    where, k_aug, stride, ones = placement(k, b is not None, pad, row_align)
    buf = torch.zeros(n, stride, dtype=w.dtype, device=w.device)
    buf[:, :k] = w
    ws_aug = ws.float().contiguous()
    if where == "pad":
        ws_aug = _bias_in_pad(w, ws, b, buf).contiguous()
    elif where == "block":
        q, s = split_bias_fp8(b)
        buf[:, ones[0]: k_aug] = q
        ws_aug = torch.cat([ws_aug, s[:, None]], dim=1).contiguous()  # [NB, KB0 + 1]
    return AugWeight(buf[:, :k_aug], ws_aug, ones)


def augment_activations(x: torch.Tensor, aug: AugWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (a e4m3 [M, K'] with aug.w's row stride, scales [M, KB'] M-major, M_al % 4 == 0):
    the activation side of `augment_weight`, with the constant-1 columns where it holds a bias."""
    xq, xs = quantize_act_1x128(x, k_pad=aug.w.stride(0), m_align=4, ones=aug.ones)
    return xq[:, : aug.w.shape[1]], xs


def config_for(m: int, n: int, k_aug: int) -> dg.DgConfig:
    """The launcher for M rows of an [N, K'] augmented weight: a tile by (M, N, K blocks), with N and
    K' compiled in (DeepGEMM's JIT does the same: +1.5-3.7 % at M = 8192 in DG13)."""
    kb = -(-k_aug // BLOCK)
    tile = next((cfg for (tn, tkb, lo, hi), cfg in TILES.items() if (tn, tkb) == (n, kb) and lo <= m <= hi),
                SMALL if m <= SMALL_MAX_M else LARGE_DEFAULT)
    return dataclasses.replace(tile, shape_n=n, shape_k=k_aug)


def launcher_configs(shapes: Iterable[tuple[int, int, bool]], row_align: int = ROW_ALIGN) -> list[dg.DgConfig]:
    """Every launcher the (N, K, has bias) weights need: one per M range with its own tile."""
    out = []
    for n, k, has_bias in shapes:
        k_aug = placement(k, has_bias, row_align=row_align)[1]
        kb = -(-k_aug // BLOCK)
        own = [m for (tn, tkb, lo, hi) in TILES if (tn, tkb) == (n, kb) for m in (lo, hi + 1) if m <= ANY_M]
        bounds = [1, SMALL_MAX_M + 1, *own]
        out += [config_for(m, n, k_aug) for m in bounds]
    return list(dict.fromkeys(out))


class DeepGemmLinear:
    name = "deepgemm"

    def __init__(self, row_align: int = ROW_ALIGN) -> None:
        self._aug = _DerivedCache()
        self.row_align = row_align

    def prepare(self, device: torch.device, shapes: Iterable[tuple[int, int, bool]] = ()) -> None:
        """Builds/loads the launchers for these (N, K, has bias) weights now (N and K are compiled
        into each), so a missing toolchain fails at start-up, not mid-request."""
        dg.prepare(launcher_configs(shapes, self.row_align), device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
                 bias: torch.Tensor | None) -> torch.Tensor:
        if w_scale is None:
            return F.linear(x, w, bias)
        x2, lead = _flatten(x)
        m, n = x2.shape[0], w.shape[0]
        aug = self._aug.get(w, ("aug", bias is not None and bias.data_ptr()),
                            lambda: augment_weight(w, w_scale, bias, self.row_align))
        a, xs = augment_activations(x2, aug)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        dg.gemm(config_for(m, n, aug.w.shape[1]), a, xs, aug.w, aug.ws, y)
        return y.to(x.dtype).reshape(*lead, n)
