"""A 'scripted' checkpoint: real HF layout, tiny preset, weights built so the model deterministically
emits a given token chain. Every layer adds zero (O projection and expert down-projection zeroed),
so the last hidden state is the current token's embedding; script tokens get orthogonal embeddings
and the unembedding maps token i of the script to token i+1. Used to drive real tool calls through
the whole serving path with a model we control."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.checkpoint_io import write_random_checkpoint
from model.config import preset


def write_scripted_checkpoint(out: Path, chain: list[int], seed: int = 0) -> Path:
    cfg = preset("tiny")
    assert len(set(chain)) == len(chain) and len(chain) <= cfg.hidden_size, "chain tokens must be distinct"
    write_random_checkpoint(cfg, out, seed=seed)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(index.values())):
        tensors = load_file(str(out / shard))
        for name, t in tensors.items():
            if name.endswith("o_proj.weight") or name.endswith("o_proj.bias") or name.endswith("down_proj_bias"):
                tensors[name] = torch.zeros_like(t)
            elif name.endswith("down_proj_blocks"):
                tensors[name] = torch.zeros_like(t)  # all-zero nibbles: every expert outputs 0
            elif name == "model.norm.weight":
                tensors[name] = torch.ones_like(t)
            elif name == "model.embed_tokens.weight":
                for i, tok in enumerate(chain):
                    t[tok] = 0
                    t[tok, i] = 1.0
            elif name == "lm_head.weight":
                t.mul_(0.01)
                for i, nxt in enumerate(chain[1:]):
                    t[nxt] = 0
                    t[nxt, i] = 10.0
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out
