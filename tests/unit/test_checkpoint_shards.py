"""`tandem make-checkpoint --max-shard-gib` (launcher/cmd_checkpoint.py -> model/checkpoint_io.py's shard
writer): a tiny checkpoint written with a very small shard size is split into several safetensors files
named `model-0000i-of-0000n.safetensors`, each within the size unless it holds one larger tensor alone,
with a model.safetensors.index.json that maps every tensor to the file holding it and totals their
bytes; it loads back tensor for tensor, and into the engine's model, identical to the same seed written
as one file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.build import EngineConfig, load_model
from launcher.cli import main as tandem
from model.config import preset
from model.loader import validate_source
from model.weights import SafetensorsSource, expected_tensors

MAX_SHARD_GIB = 2**-14  # 64 KiB: the tiny preset's embedding and lm_head (25 MB each) exceed it alone


def test_small_max_shard_gib_splits_the_checkpoint_and_it_loads_back_identically(tmp_path, ckpt_factory, capsys):
    out = tmp_path / "sharded"
    assert tandem(["make-checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(out),
                   "--max-shard-gib", repr(MAX_SHARD_GIB)]) == 0
    assert "wrote tiny" in capsys.readouterr().out
    max_bytes = int(MAX_SHARD_GIB * 2**30)

    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 4, shards
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]

    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert set(wm) == set(expected_tensors(preset("tiny")))
    assert set(wm.values()) == set(shards)  # every shard is named, no name points elsewhere
    total = 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            names = set(f.keys())
            assert names == {k for k, v in wm.items() if v == shard}, shard
            nbytes = sum(t.numel() * t.element_size() for t in map(f.get_tensor, names))
        assert nbytes <= max_bytes or len(names) == 1, (shard, nbytes, names)
        total += nbytes
    assert index["metadata"]["total_size"] == total

    ref_dir = ckpt_factory("tiny", 0)  # the same seed, written with the default size: one file
    assert [p.name for p in Path(ref_dir).glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]
    src, ref = SafetensorsSource(out), SafetensorsSource(ref_dir)
    validate_source(src)
    assert sorted(src.names()) == sorted(ref.names())
    for name in ref.names():
        a, b = src.get(name), ref.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name

    got, want = (dict(load_model(EngineConfig(checkpoint=str(d), progress=False)).named_parameters())
                 for d in (out, ref_dir))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
