"""`tandem make-checkpoint` (random checkpoints in the exact HF layout) and `tandem convert`
(HF checkpoint -> FP8 e4m3 with 128x128 block scales)."""

from __future__ import annotations

import argparse
import json

from model.checkpoint_io import convert_to_fp8, write_random_checkpoint
from model.config import PRESETS, preset
from model.weights import SafetensorsSource


def make_checkpoint(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem make-checkpoint",
                                description="write a deterministic random gpt-oss checkpoint in the HF layout")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-gib", type=float, default=2.0)
    a = p.parse_args(argv)
    cfg = preset(a.preset)
    path = write_random_checkpoint(cfg, a.out, seed=a.seed, max_shard_bytes=int(a.max_shard_gib * 2**30),
                                   progress=True)
    print(f"wrote {a.preset} ({cfg.num_params() / 1e6:.2f} M params, seed {a.seed}) to {path}")
    return 0


def convert(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem convert",
                                description="convert an HF gpt-oss checkpoint to FP8 e4m3 with 128x128 block scales")
    p.add_argument("--checkpoint", required=True, help="input directory (HF layout, MXFP4 or bf16 experts)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    stats = convert_to_fp8(SafetensorsSource(a.checkpoint), a.out)
    report = {k: {"tiles": s.tiles, "inexact_tiles": s.inexact_tiles, "rel_err": s.rel_err,
                  "max_abs_err": s.max_abs_err} for k, s in stats.items()}
    print(json.dumps(report, indent=2))
    e = stats["experts"]
    print(f"experts: {e.inexact_tiles} of {e.tiles} 128x128 tiles not exactly representable "
          f"(MXFP4 exponent spread > 14), relative error {e.rel_err:.3e}")
    return 0
