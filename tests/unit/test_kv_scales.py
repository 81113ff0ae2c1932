"""FP8 KV scales: where they come from (checkpoint names vLLM loads, start-up calibration, 1.0),
their arithmetic, the capacity they buy, and the committed calibration passages."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from common.errors import CheckpointError, ConfigError
from engine.build import EngineConfig, build_engine_parts, load_model
from engine.kv_calibration import PROMPTS_FILE, calibration_prompts, measure_kv_amax
from model.config import preset
from model.kv_cache import PageGroup, plan_kv_cache, resolve_kv_dtype
from model.kv_scales import KVScales, scales_from_checkpoint

FP8 = torch.float8_e4m3fn


def test_fp8_kv_scales_from_amax_are_powers_of_two_with_headroom():
    amax = torch.tensor([[0.0, 1.0, 100.0, 224.0], [225.0, 3e4, 1e-3, 5.9]])
    s = KVScales.from_amax(amax, amax, "calibrated:1")
    assert torch.equal(torch.exp2(torch.log2(s.k).round()), s.k)  # powers of two
    assert s.k[0, 0] == 1.0  # never seen: 1.0
    assert (amax * 2 <= 448 * s.k).all()  # >= 2x headroom below e4m3's max
    assert (amax * 2 > 448 * s.k / 2)[amax > 0].all()  # and the smallest such power of two
    assert s.k[0, 3] == 1.0 and s.k[1, 0] == 2.0
    assert s.tag.startswith("calibrated:1:") and KVScales.default(2, 4).tag == "default"
    with pytest.raises(CheckpointError, match="positive finite"):
        KVScales(torch.zeros(1, 2), torch.ones(1, 2), "checkpoint")


def test_fp8_kv_dtype_names_and_capacity_doubles():
    assert resolve_kv_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_dtype("fp8", torch.float32) == FP8
    with pytest.raises(ConfigError, match="KV cache dtype"):
        resolve_kv_dtype("int4", torch.bfloat16)
    cfg = preset("gpt-oss-20b")
    bf16 = plan_kv_cache(cfg, 40 << 30, dtype=torch.bfloat16)
    fp8 = plan_kv_cache(cfg, 40 << 30, dtype=FP8)
    assert bf16.page_bytes(PageGroup.FULL) == 2 * fp8.page_bytes(PageGroup.FULL) == 12 * 2 * 8 * 16 * 64 * 2
    assert fp8.num_pages[PageGroup.FULL] > 2 * bf16.num_pages[PageGroup.FULL]  # the rings' share halves too


def _checkpoint_with_scales(ckpt_factory, tmp_path, tensors: dict[str, torch.Tensor]) -> str:
    src = ckpt_factory("tiny-a")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    save_file(tensors, str(dst / "kv-scales.safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: "kv-scales.safetensors" for name in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(dst)


def test_fp8_kv_scales_from_the_checkpoint(ckpt_factory, tmp_path):
    """vLLM's names, a scalar per layer (k_scale) or one per KV head (ModelOpt's v_proj.v_scale)."""
    cfg = preset("tiny-a")
    n, h = cfg.num_hidden_layers, cfg.num_key_value_heads
    tensors = {}
    for i in range(n):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.arange(1, h + 1, dtype=torch.float32) * 0.25
    path = _checkpoint_with_scales(ckpt_factory, tmp_path, tensors)
    parts = build_engine_parts(EngineConfig(checkpoint=path, kv_cache_dtype="fp8", kv_cache_bytes=1 << 20,
                                            kv_scale_calibration=3))  # the checkpoint's win over calibration
    pool = parts.pool
    assert pool.scales.source == "checkpoint" and pool.scales_tag.startswith("checkpoint:")
    assert torch.equal(pool.k_scale[:, 0], torch.arange(n) + 0.5) and torch.equal(pool.k_scale[:, 0], pool.k_scale[:, -1])
    assert torch.equal(pool.v_scale[2], torch.arange(1, h + 1) * 0.25)
    # bf16/fp32 pages ignore them
    assert build_engine_parts(EngineConfig(checkpoint=path, kv_cache_bytes=1 << 20)).pool.scales is None


def test_fp8_kv_partial_checkpoint_scales_are_refused(ckpt_factory, tmp_path):
    path = _checkpoint_with_scales(ckpt_factory, tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match="some layers only"):
        load_model(EngineConfig(checkpoint=path))
    names = {f"model.layers.{i}.self_attn.kv_scale" for i in range(2)}
    got = scales_from_checkpoint(names, lambda name: torch.tensor([2.0, 4.0]), 2, 2)
    assert got.source == "checkpoint" and torch.equal(got.k, got.v) and got.k.tolist() == [[2.0, 4.0]] * 2
    with pytest.raises(CheckpointError, match="one per KV head"):
        scales_from_checkpoint(names, lambda name: torch.ones(3), 2, 2)


def test_fp8_kv_calibration_measures_k_after_rope_and_v(ckpt_factory):
    """measure_kv_amax sees exactly what attention receives (recorded per layer and head), and the
    tables of two independent runs agree (what the KV handshake will compare)."""
    model = load_model(EngineConfig(checkpoint=ckpt_factory("tiny-a")))
    prompts = calibration_prompts(2, model.cfg.vocab_size)
    assert len(prompts) == 2 and prompts[0] != prompts[1] and max(max(p) for p in prompts) < 512
    seen_k, seen_v = torch.zeros(4, 2), torch.zeros(4, 2)
    real = model.backends.attention

    class Spy:
        name, calls = "spy", 0

        def plan(self, step):
            self.calls = 0
            real.plan(step)

        def forward(self, group, q, k, v, kv, sinks, sm_scale, window, kv_scale=None):
            seen_k[self.calls] = torch.maximum(seen_k[self.calls], k.abs().amax(dim=(0, 2)))
            seen_v[self.calls] = torch.maximum(seen_v[self.calls], v.abs().amax(dim=(0, 2)))
            self.calls += 1
            return real.forward(group, q, k, v, kv, sinks, sm_scale, window, kv_scale=kv_scale)

    k, v = measure_kv_amax(model, prompts[:1])
    assert model.backends.attention is real
    model.backends.attention = Spy()
    k2, v2 = measure_kv_amax(model, prompts[:1])  # wraps the spy: both see the same tensors
    model.backends.attention = real
    assert torch.equal(k, seen_k) and torch.equal(v, seen_v) and (k > 0).all()
    assert KVScales.from_amax(k, v, "c").tag == KVScales.from_amax(k2, v2, "c").tag


def test_fp8_kv_calibration_passages_are_the_tokenizers_ids():
    """The committed ids are o200k_harmony's encoding of the committed text (regenerate both
    together if the passages change)."""
    from router.tokenizer import Tokenizer

    tok = Tokenizer()
    doc = json.loads(PROMPTS_FILE.read_text())
    assert doc["tokenizer"] == "o200k_harmony" and len(doc["passages"]) >= 5
    for p in doc["passages"]:
        assert tok.encode(p["text"]) == p["ids"]
    assert sum(len(p["ids"]) for p in doc["passages"]) > 1000
