"""The embedded demo model: a tiny gpt-oss trained by the project (training/) to answer.

`gpt-oss-tiny-demo.safetensors` holds every tensor of the HF checkpoint under its HF name, in its
stored format (bf16, MXFP4 blocks/scales for the experts, fp32 norms), except that
`model.embed_tokens.weight` and `lm_head.weight` keep only the rows of the tokens the training data
uses; `demo.vocab_ids` [n] int32 says which o200k_harmony ids those rows belong to. The checkpoint
writer (model.checkpoint_io.write_demo_checkpoint) puts them back into 201,088-row matrices: other
tokens get a zero embedding and the one unembedding row `demo.unused_head_row` [H], trained so that
their shared logit stays below the trained answers (the training loss was the cross entropy of
exactly that full-vocabulary model). The file's metadata holds the model's HF config.json
(`config`; the sweep may pick another width or depth than the `tiny-demo` preset) and the training
run (`training`: command line, seed, steps, minutes, accuracy).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import CheckpointError
from model.config import GptOssConfig, preset

DEMO_PRESET = "tiny-demo"  # the default shape of training.train
DEMO_FILE = Path(__file__).with_name("gpt-oss-tiny-demo.safetensors")
VOCAB_IDS = "demo.vocab_ids"
UNUSED_ROW = "demo.unused_head_row"
PRODUCED_BY = ("the `demo-train-long` GPU suite (python3 -m launcher.cli bench suite demo-train-long --out "
               "$OUT/demo-train-long --tar, see benchmarks/suites.py), which leaves gpt-oss-tiny-demo.safetensors "
               "in its output")


def save_compact(tensors: dict[str, torch.Tensor], vocab_ids: list[int], path: Path, meta: dict,
                 cfg: GptOssConfig) -> Path:
    """tensors: HF names -> stored tensors (embedding and unembedding with len(vocab_ids) rows)."""
    n = len(vocab_ids)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if tensors[name].shape[0] != n:
            raise CheckpointError(f"{name} has {tensors[name].shape[0]} rows for {n} vocabulary ids")
    out = {k: v.contiguous() for k, v in tensors.items()}
    out[VOCAB_IDS] = torch.tensor(vocab_ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, quant_method="mxfp4")
    save_file(out, str(path), metadata={"format": "tandem-demo", "config": json.dumps(cfg.to_hf_dict(), sort_keys=True),
                                        "training": json.dumps(meta, sort_keys=True)})
    path.chmod(0o644)  # safetensors writes 0600; the file is meant to be committed and shared
    return path


def load_compact(path: Path = DEMO_FILE) -> tuple[dict[str, torch.Tensor], dict, GptOssConfig]:
    """-> (tensors incl. demo.vocab_ids and demo.unused_head_row, the training metadata, the config)."""
    if not path.exists():
        raise CheckpointError(f"the demo model {path} is missing: it is trained on a GPU by {PRODUCED_BY}; "
                              f"copy that file to {DEMO_FILE}")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if "config" in meta:
        cfg = GptOssConfig.from_hf_dict(json.loads(meta["config"]))
    elif meta.get("preset") == DEMO_PRESET:  # the first files named their preset instead
        cfg = dataclasses.replace(preset(DEMO_PRESET), quant_method="mxfp4")
    else:
        raise CheckpointError(f"{path} is not a demo model file (no config in its metadata)")
    return tensors, json.loads(meta.get("training", "{}")), cfg
