import json

import pytest
import torch

from common.errors import ConfigError
from model.checkpoint_io import write_configs
from model.config import FULL, SLIDING, GptOssConfig, preset, yarn_bounds
from model.rope import yarn_inv_freq

HUB_20B = {  # the hub config.json spelling: legacy rope_scaling + top-level rope_theta
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "experts_per_token": 4, "head_dim": 64, "hidden_size": 2880, "initial_context_length": 4096,
    "intermediate_size": 2880, "max_position_embeddings": 131072, "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "pad_token_id": 199999, "eos_token_id": 200002, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4"},
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}


def test_hub_config_matches_20b_preset():
    cfg = GptOssConfig.from_hf_dict(HUB_20B)
    p = preset("gpt-oss-20b")
    assert cfg.rope == p.rope and cfg.layer_types == p.layer_types
    assert cfg.num_local_experts == 32 and cfg.quant_method == "mxfp4"
    assert abs(cfg.num_params() / 1e9 - 20.91) < 0.01
    assert abs(preset("gpt-oss-120b").num_params() / 1e9 - 116.83) < 0.01


def test_rope_parameters_spelling_and_truncate_default():
    d = dict(HUB_20B)
    rs = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = dict(rs, rope_theta=150000.0)
    assert GptOssConfig.from_hf_dict(d).rope == GptOssConfig.from_hf_dict(HUB_20B).rope
    # Without the key HF truncates (floor/ceil) the ramp bounds: keep that meaning.
    d["rope_parameters"].pop("truncate")
    cfg = GptOssConfig.from_hf_dict(d)
    assert cfg.rope.truncate
    assert yarn_bounds(cfg.rope, 64) == (8, 18)
    low, high = yarn_bounds(GptOssConfig.from_hf_dict(HUB_20B).rope, 64)
    assert abs(low - 8.092779) < 1e-6 and abs(high - 17.398025) < 1e-6


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_inv_freq_matches_transformers(truncate):
    from transformers import GptOssConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = json.loads(json.dumps(HUB_20B))
    d["rope_scaling"]["truncate"] = truncate
    ours, conc = yarn_inv_freq(GptOssConfig.from_hf_dict(d))
    hf_cfg = HFConfig(**{k: v for k, v in d.items() if k not in ("architectures", "quantization_config")})
    theirs, attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=0)
    assert abs(conc - attn_factor) < 1e-12 and abs(conc - 1.3465736) < 1e-6


def test_layer_types_default_and_validation():
    cfg = preset("tiny")
    assert cfg.layer_types[:2] == (SLIDING, FULL)
    with pytest.raises(ConfigError, match="layer_types"):
        GptOssConfig.from_hf_dict(dict(HUB_20B, layer_types=["full_attention"] * 3))
    with pytest.raises(ConfigError, match="model_type"):
        GptOssConfig.from_hf_dict(dict(HUB_20B, model_type="llama"))
    with pytest.raises(ConfigError, match="missing required key"):
        GptOssConfig.from_hf_dict({k: v for k, v in HUB_20B.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("gpt-oss-7b")


def test_config_json_round_trip(tmp_path):
    for name in ("tiny", "tiny-a", "tiny-b", "gpt-oss-120b"):
        cfg = preset(name)
        write_configs(tmp_path, cfg)  # config.json + generation_config.json (eos list lives there)
        back = GptOssConfig.from_file(tmp_path)
        assert back == cfg, name
