"""Launch configurations for our Triton GEMMs, specialised for gpt-oss (hidden 2880, expert
intermediate 2880): JSON tables in this folder, keyed by (M bucket, N, K), written by
`benchmarks/tune_moe.py` on an H200 and read once per process.

Table format: {"_meta": {...}, "<key>": {"<M bucket>": entry}}. A lookup picks the bucket nearest
to M on a log scale. Keys without an entry fall back to `default_*` below (untuned heuristics),
which is also what the shipped tables hold until the tuner has run (their `_meta.tuned` says so).

  * dense FP8 linear (`fp8_gemm.json`): key "N{N}_K{K}", M = tokens; entry = TileConfig fields.
  * MoE (`moe.json`): key "{fp8|bf16}_N{2I}_K{H}", M = routed rows per expert (T * top_k / E);
    entry = {"block_m", "gemm1": TileConfig fields, "gemm2": TileConfig fields}. One block_m for
    both GEMMs because the token grouping is padded to it.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

TUNING_DIR = Path(__file__).parent


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # MoE decode: K split over this many CTAs per tile (fp32 partials, then a fix-up kernel that sums
    # them in split order: deterministic). More CTAs in flight when few tiles exist (batch 1: 4 experts).
    split_k: int = 1
    # FP8 expert GEMMs: weight tiles by TMA (tensor descriptors) instead of per-thread copies.
    tma: bool = False

    def to_json(self) -> dict[str, int]:
        d = asdict(self)
        if not self.tma:
            del d["tma"]  # tables written before the field stay byte-identical
        return d

    @staticmethod
    def from_json(d: dict[str, int]) -> TileConfig:
        return TileConfig(int(d["block_m"]), int(d["block_n"]), int(d["block_k"]), int(d.get("group_m", 1)),
                          int(d["num_warps"]), int(d["num_stages"]), int(d.get("split_k", 1)),
                          bool(d.get("tma", False)))


@dataclass(frozen=True, slots=True)
class MoEConfig:
    block_m: int
    gemm1: TileConfig  # gate_up (+ SwiGLU, + FP8 re-quantisation fused iff FP8 and block_n == 256)
    gemm2: TileConfig  # down (+ b2, x routing weight)

    def __post_init__(self) -> None:
        assert self.gemm1.block_m == self.block_m == self.gemm2.block_m, "one block_m for both GEMMs"

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "gemm1": self.gemm1.to_json(), "gemm2": self.gemm2.to_json()}

    @staticmethod
    def from_json(d: dict) -> MoEConfig:
        bm = int(d["block_m"])
        g1 = TileConfig.from_json({**d["gemm1"], "block_m": bm})
        g2 = TileConfig.from_json({**d["gemm2"], "block_m": bm})
        return MoEConfig(bm, g1, g2)


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[str, dict[int, dict]]:
    path = TUNING_DIR / name
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {k: {int(m): e for m, e in v.items()} for k, v in raw.items() if not k.startswith("_")}


def nearest_bucket(buckets: dict[int, dict], m: int) -> dict:
    lm = math.log2(max(m, 1))
    return buckets[min(buckets, key=lambda b: (abs(math.log2(b) - lm), b))]


def default_gemm_config(m: int) -> TileConfig:
    """Untuned dense FP8 tiles: small-M is bandwidth-bound (narrow N tiles, many CTAs)."""
    if m <= 16:  # N / 32 column tiles: 160 CTAs for qkv (N = 5120) stream the weights
        return TileConfig(16, 32, 128, 1, 4, 4)
    if m <= 64:
        return TileConfig(64, 64, 128, 1, 4, 4)
    if m <= 256:
        return TileConfig(64, 128, 128, 8, 4, 4)
    return TileConfig(128, 128, 128, 8, 8, 3)


def gemm_config(m: int, n: int, k: int) -> TileConfig:
    buckets = load_table("fp8_gemm.json").get(f"N{n}_K{k}")
    return TileConfig.from_json(nearest_bucket(buckets, m)) if buckets else default_gemm_config(m)


def default_moe_config(m: int, fp8: bool) -> MoEConfig:
    """Untuned MoE tiles by routed rows per expert. FP8 gate_up tiles are 256 wide so one tile holds
    exactly one 1x128 group of SwiGLU outputs and re-quantisation fuses into its epilogue. FP8 keeps
    two fp32 accumulators (the per-block dot and the scaled sum), so large FP8 tiles stay at 64 rows
    with 8 warps (two warpgroups of 64 x 128 each) to avoid register spills."""
    bk = 128 if fp8 else 64
    if m <= 16:
        bm, n1, n2, w, s, g = 16, 256 if fp8 else 128, 64, 4, 4, 1
    elif m <= 64:
        bm, n1, n2, w, s, g = 32, 256 if fp8 else 128, 128, 4, 4, 1
    elif m <= 256 or fp8:
        bm, n1, n2, w, s, g = 64, 256 if fp8 else 128, 256 if fp8 else 128, 8, 3, 8
    else:
        bm, n1, n2, w, s, g = 128, 128, 128, 8, 3, 8
    return MoEConfig(bm, TileConfig(bm, n1, bk, g, w, s), TileConfig(bm, n2, bk, g, w, s))


def moe_config(m: int, n1: int, k1: int, fp8: bool) -> MoEConfig:
    key = f"{'fp8' if fp8 else 'bf16'}_N{n1}_K{k1}"
    buckets = load_table("moe.json").get(key)
    return MoEConfig.from_json(nearest_bucket(buckets, m)) if buckets else default_moe_config(m, fp8)
