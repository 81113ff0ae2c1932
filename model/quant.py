"""Weight formats: MXFP4 (the HF checkpoint's experts) and FP8 e4m3 with 128x128 block scales.

MXFP4 (MODEL_SPEC.md §1.4): blocks [..., N, K/32, 16] u8 hold 32 input-dim elements per block,
two per byte, LOW nibble = even element; scales [..., N, K/32] u8 are UE8M0 exponents, bias 127.
FP8 conversion of MXFP4 is exact for a 128x128 tile iff the spread of its 32-group exponents is
<= 14: with tile scale 2^(Smax-133) every e2m1 value lands on the e4m3 grid (including subnormals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import BLOCK, FP8_MAX, dequantize_fp8_blockwise, quantize_fp8_blockwise

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """[..., N, G, 16] u8 + [..., N, G] u8 -> [..., N, G*32] (checkpoint orientation, out x in).

    Same operations as transformers' `_convert_moe_packed_tensors` (LUT in `dtype`, then ldexp),
    so results agree bit for bit; HF additionally transposes to [..., in, out].
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    exp = scales.to(torch.int32) - 127
    *lead, g, b = blocks.shape
    out = torch.empty(*lead, g, b * 2, dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exp[..., None], out=out)
    return out.reshape(*lead, g * b * 2)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K % 32 == 0) -> (blocks [..., N, K/32, 16] u8, scales [..., N, K/32] u8).

    Per 32-group: the smallest power-of-two scale with |w|/scale <= 6, then round-to-nearest on the
    e2m1 grid (ties to the larger magnitude index are fine: this is a writer for test weights).
    """
    *lead, n, k = w.shape
    if k % 32:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of 32, got {k}")
    g = w.float().reshape(*lead, n, k // 32, 32)
    amax = g.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    scaled = g / torch.exp2(e)[..., None]
    mags = _FP4_MAGNITUDES.to(w.device)
    idx = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude index 0..7
    idx = idx | ((scaled < 0).to(idx.dtype) << 3)
    idx = idx.to(torch.uint8).reshape(*lead, n, k // 32, 16, 2)
    blocks = idx[..., 0] | (idx[..., 1] << 4)
    return blocks.contiguous(), (e + 127).to(torch.uint8)


@dataclass(slots=True)
class Fp8ConversionStats:
    tiles: int = 0
    inexact_tiles: int = 0  # exponent spread > 14: some values rounded or flushed
    max_abs_err: float = 0.0
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0

    def add(self, other: Fp8ConversionStats) -> None:
        self.tiles += other.tiles
        self.inexact_tiles += other.inexact_tiles
        self.max_abs_err = max(self.max_abs_err, other.max_abs_err)
        self.sum_sq_err += other.sum_sq_err
        self.sum_sq_ref += other.sum_sq_ref

    @property
    def rel_err(self) -> float:
        return (self.sum_sq_err / self.sum_sq_ref) ** 0.5 if self.sum_sq_ref > 0 else 0.0


def quantize_fp8_pow2(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Fp8ConversionStats]:
    """[..., N, K] -> (e4m3, fp32 scale [..., ceil(N/128), ceil(K/128)]) with power-of-two tile scales
    2^ceil(log2(amax/448)). For MXFP4-origin values this is 2^(Smax-133) when the tile maximum is
    6 or 4 (one more bit of headroom otherwise), so the conversion is exact whenever the tile's
    exponent spread allows it; the stats count the tiles that were not."""
    *lead, n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    wf = w.float()
    pad = torch.nn.functional.pad(wf, (0, kb * BLOCK - k, 0, nb * BLOCK - n)).reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = pad.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))), torch.ones_like(amax))
    q = (pad / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    err = (q.float() * scale[..., :, None, :, None] - pad)
    tile_bad = (err != 0).any(dim=-1).any(dim=-2)  # [..., nb, kb]
    q = q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :n, :k].contiguous()
    st = Fp8ConversionStats(tiles=scale.numel(), inexact_tiles=int(tile_bad.sum()),
                            max_abs_err=float(err.abs().max()) if err.numel() else 0.0,
                            sum_sq_err=float(err.pow(2).sum()), sum_sq_ref=float(wf.pow(2).sum()))
    return q, scale, st


def mxfp4_to_fp8(blocks: torch.Tensor, scales: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Fp8ConversionStats]:
    """MXFP4 [E, N, G, 16] / [E, N, G] -> (e4m3 [E, N, K], fp32 scale [E, ceil(N/128), ceil(K/128)]).
    Processed per expert to bound memory on 120b-sized tensors."""
    outs, scs, stats = [], [], Fp8ConversionStats()
    for e in range(blocks.shape[0]):
        q, s, st = quantize_fp8_pow2(dequantize_mxfp4(blocks[e], scales[e], torch.float32))
        outs.append(q)
        scs.append(s)
        stats.add(st)
    return torch.stack(outs), torch.stack(scs), stats


def dense_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Fp8ConversionStats]:
    """bf16/fp32 [..., N, K] -> e4m3 + fp32 128x128 scales (amax / 448 per tile), with its error."""
    q, s = quantize_fp8_blockwise(w)
    err = dequantize_fp8_blockwise(q, s) - w.float()
    *lead, n, k = w.shape
    nb, kb = s.shape[-2:]
    tile_err = torch.nn.functional.pad(err.abs(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    tile_err = tile_err.reshape(*lead, nb, BLOCK, kb, BLOCK).amax(dim=(-3, -1))
    st = Fp8ConversionStats(tiles=s.numel(), inexact_tiles=int((tile_err > 0).sum()),
                            max_abs_err=float(err.abs().max()) if err.numel() else 0.0,
                            sum_sq_err=float(err.pow(2).sum()), sum_sq_ref=float(w.float().pow(2).sum()))
    return q, s, st
