"""Writing checkpoints: tiny random ones in the exact HF layout (`tandem make-checkpoint`) and the
FP8 128x128 conversion of any checkpoint (`tandem convert`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from common.errors import CheckpointError
from model.config import GptOssConfig
from model.loader import FP8_SCALE_SUFFIX, validate_source
from model.quant import Fp8ConversionStats, dense_to_fp8, dequantize_mxfp4, quantize_fp8_pow2
from model.weights import RandomSource, TensorSource, expected_tensors

# The hub's generation_config.json; 200012 (<|call|>) stops tool calls (MODEL_SPEC.md §3).
GENERATION_CONFIG = {"bos_token_id": 199998, "do_sample": True, "eos_token_id": [200002, 199999, 200012],
                     "pad_token_id": 199999}


class _ShardWriter:
    """Buffers tensors into ~max_bytes safetensors shards plus the HF index."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out, self.max_bytes = out, max_bytes
        self.buf: dict[str, torch.Tensor] = {}
        self.size, self.shards, self.weight_map = 0, 0, {}
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.buf and self.size + nbytes > self.max_bytes:
            self.flush()
        self.buf[name] = t.contiguous().cpu()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.buf:
            return
        self.shards += 1
        fname = f"model-{self.shards:05d}.safetensors"
        save_file(self.buf, str(self.out / fname), metadata={"format": "pt"})
        self.weight_map.update({k: fname for k in self.buf})
        self.buf, self.size = {}, 0

    def finish(self) -> None:
        self.flush()
        # Rename to the HF "-of-" convention once the count is known.
        renames = {}
        for i in range(1, self.shards + 1):
            old, new = f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{self.shards:05d}.safetensors"
            (self.out / old).rename(self.out / new)
            renames[old] = new
        wm = {k: renames[v] for k, v in sorted(self.weight_map.items())}
        index = {"metadata": {"total_size": self.total}, "weight_map": wm}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_configs(out: Path, cfg: GptOssConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    gen = dict(GENERATION_CONFIG, eos_token_id=list(cfg.eos_token_ids), pad_token_id=cfg.pad_token_id)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_random_checkpoint(cfg: GptOssConfig, out: str | Path, *, seed: int = 0,
                            max_shard_bytes: int = 2 << 30, progress: bool = False) -> Path:
    """A random checkpoint in the exact HF layout (MXFP4 experts), deterministic from `seed`."""
    out = Path(out)
    cfg = dataclasses.replace(cfg, quant_method="mxfp4")
    write_configs(out, cfg)
    src = RandomSource(cfg, seed)
    w = _ShardWriter(out, max_shard_bytes)
    for name in tqdm(src.names(), desc="writing", disable=not progress):
        w.add(name, src.get(name))
    w.finish()
    return out


def convert_to_fp8(src: TensorSource, out: str | Path, *, progress: bool = True,
                   max_shard_bytes: int = 4 << 30) -> dict[str, Fp8ConversionStats]:
    """HF checkpoint -> FP8 e4m3 with one fp32 scale per 128x128 tile. Attention projections use
    amax/448 scales (lossy, bf16 source); experts use power-of-two scales (exact where the tile's
    MXFP4 exponent spread is <= 14). Returns stats for 'experts' and 'attention'."""
    validate_source(src)
    cfg = src.config
    if cfg.quant_method not in ("mxfp4", "none"):
        raise CheckpointError(f"cannot convert a {cfg.quant_method!r} checkpoint to FP8 (need mxfp4 or none)")
    out = Path(out)
    write_configs(out, dataclasses.replace(cfg, quant_method="fp8"))
    stats = {"experts": Fp8ConversionStats(), "attention": Fp8ConversionStats()}
    w = _ShardWriter(out, max_shard_bytes)
    names = src.names()
    for name in tqdm(names, desc="converting", disable=not progress):
        if name.endswith("_scales"):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            qs, ss = [], []
            for e in range(src.shape(name)[0]):  # per expert: bounded memory on 120b
                deq = dequantize_mxfp4(src.get_rows(name, e, e + 1)[0], src.get_rows(base + "_scales", e, e + 1)[0],
                                       torch.float32)
                q, s, st = quantize_fp8_pow2(deq)
                qs.append(q)
                ss.append(s)
                stats["experts"].add(st)
            w.add(base + ".weight", torch.stack(qs))
            w.add(base + ".weight" + FP8_SCALE_SUFFIX, torch.stack(ss))
        elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            q, s, st = quantize_fp8_pow2(src.get(name).float().transpose(1, 2))  # -> [E, out, in]
            stats["experts"].add(st)
            w.add(name + ".weight", q)
            w.add(name + ".weight" + FP8_SCALE_SUFFIX, s)
        elif ".self_attn." in name and name.endswith("_proj.weight"):
            q, s, st = dense_to_fp8(src.get(name))
            stats["attention"].add(st)
            w.add(name, q)
            w.add(name + FP8_SCALE_SUFFIX, s)
        else:
            w.add(name, src.get(name))
    w.finish()
    return stats


def write_demo_checkpoint(out: str | Path, compact: Path | None = None) -> Path:
    """The embedded demo model (model.demo) in the exact HF layout: the stored tensors as they are,
    the embedding and unembedding expanded to the full vocabulary; a token the model was not trained
    on gets a zero embedding and the shared unembedding row trained for all of them. Deterministic."""
    from model.demo import DEMO_FILE, UNUSED_ROW, VOCAB_IDS, load_compact

    out = Path(out)
    tensors, _, cfg = load_compact(compact or DEMO_FILE)
    ids = tensors.pop(VOCAB_IDS).long()
    unused_row = tensors.pop(UNUSED_ROW)
    want = expected_tensors(cfg)
    if set(tensors) != set(want):
        raise CheckpointError(f"demo weights do not match their config: {sorted(set(tensors) ^ set(want))[:4]}")
    write_configs(out, cfg)
    w = _ShardWriter(out, 2 << 30)
    for name, (shape, dtype) in want.items():
        t = tensors[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            full = torch.zeros(shape, dtype=dtype)
            if name == "lm_head.weight":
                full[:] = unused_row
            full[ids] = t
            t = full
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(f"demo tensor {name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
        w.add(name, t)
    w.finish()
    return out


def ensure_demo_checkpoint(cache_dir: str | Path) -> Path:
    """The default of `tandem serve`: the demo model, written once into the cache folder under a
    name that carries the weights' hash (a retrained model gets a new folder)."""
    import hashlib

    from model.demo import DEMO_FILE, load_compact

    if not DEMO_FILE.exists():
        load_compact(DEMO_FILE)  # raises CheckpointError: where the weights come from
    digest = hashlib.sha256(DEMO_FILE.read_bytes()).hexdigest()[:12]
    out = Path(cache_dir) / f"gpt-oss-tiny-demo-{digest}"
    if (out / "model.safetensors.index.json").exists():
        return out
    tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
    write_demo_checkpoint(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same folder first
        shutil.rmtree(tmp)
    return out


def ensure_checkpoint(preset_name: str, cache_dir: str | Path, seed: int = 0) -> Path:
    """The embedded default: a preset's random checkpoint, written once into the cache folder."""
    from model.config import preset

    out = Path(cache_dir) / f"{preset_name}-seed{seed}"
    if (out / "model.safetensors.index.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    write_random_checkpoint(preset(preset_name), tmp, seed=seed)
    tmp.rename(out)
    return out
