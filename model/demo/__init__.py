"""The embedded demo model: a tiny gpt-oss trained by the project (training/) to answer.

`gpt-oss-tiny-demo.safetensors` holds every tensor of the HF checkpoint under its HF name, in its
stored format (bf16, MXFP4 blocks/scales for the experts, fp32 norms), except that
`model.embed_tokens.weight` and `lm_head.weight` keep only the rows of the tokens the training data
uses; `demo.vocab_ids` [n] int32 says which o200k_harmony ids those rows belong to. The checkpoint
writer (model.checkpoint_io.write_demo_checkpoint) puts them back into 201,088-row matrices: other
tokens get a zero embedding and the one unembedding row `demo.unused_head_row` [H], trained so that
their shared logit stays below the trained answers (the training loss was the cross entropy of
exactly that full-vocabulary model). The file's metadata records the training run (seed, steps,
minutes, accuracy).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import CheckpointError

DEMO_PRESET = "tiny-demo"
DEMO_FILE = Path(__file__).with_name("gpt-oss-tiny-demo.safetensors")
VOCAB_IDS = "demo.vocab_ids"
UNUSED_ROW = "demo.unused_head_row"


def save_compact(tensors: dict[str, torch.Tensor], vocab_ids: list[int], path: Path, meta: dict) -> Path:
    """tensors: HF names -> stored tensors (embedding and unembedding with len(vocab_ids) rows)."""
    n = len(vocab_ids)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if tensors[name].shape[0] != n:
            raise CheckpointError(f"{name} has {tensors[name].shape[0]} rows for {n} vocabulary ids")
    out = {k: v.contiguous() for k, v in tensors.items()}
    out[VOCAB_IDS] = torch.tensor(vocab_ids, dtype=torch.int32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path), metadata={"preset": DEMO_PRESET, "training": json.dumps(meta, sort_keys=True)})
    return path


def load_compact(path: Path = DEMO_FILE) -> tuple[dict[str, torch.Tensor], dict]:
    """-> (tensors incl. demo.vocab_ids, the training metadata)."""
    if not path.exists():
        raise CheckpointError(f"the demo model {path} is missing (run `python -m training.train`)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("preset") != DEMO_PRESET:
        raise CheckpointError(f"{path} was trained for preset {meta.get('preset')!r}, not {DEMO_PRESET!r}")
    return tensors, json.loads(meta.get("training", "{}"))
