"""The peer in the same run: HF transformers GptOssForCausalLM (bf16, eager attention) holding the
same random weights as our FP8 model (experts dequantised from the same MXFP4 tensors), timed on
an 8k prefill and batch-1 decode, plus how often our FP8 model's top-1 token agrees with it."""

from __future__ import annotations

import gc

import torch

from benchmarks.common import Results, time_cuda
from model.config import GptOssConfig
from model.config import preset as get_preset
from model.context import SeqStep, build_step_meta
from model.quant import dequantize_mxfp4
from model.weights import RandomSource


def build_hf(preset: str | GptOssConfig, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16):
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM

    cfg = get_preset(preset) if isinstance(preset, str) else preset
    d = cfg.to_hf_dict()
    d.pop("quantization_config", None)
    d.pop("architectures", None)
    hf_cfg = HFConfig(**d)
    with torch.device(device):
        hf = GptOssForCausalLM._from_config(hf_cfg, dtype=dtype, attn_implementation="eager").eval()
    src = RandomSource(cfg, seed, fast_mxfp4=True)
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name in src.names():
            if name.endswith("_scales"):
                continue
            if name.endswith("_blocks"):
                base = name[: -len("_blocks")]
                w = dequantize_mxfp4(src.get(name, device), src.get(base + "_scales", device), dtype)
                params[base].copy_(w.transpose(1, 2))  # HF keeps experts as [E, in, out]
                del w
            else:
                params[name].copy_(src.get(name, device).to(params[name].dtype))
    return hf


def hf_peer_section(res: Results, model, preset: str, prefill_rows: list[dict], decode_rows: list[dict]) -> None:
    with res.section("hf_peer") as sec:
        dev = str(model.device)
        hf = build_hf(preset, device=dev)
        g = torch.Generator(device=dev).manual_seed(0)
        n_pre = 8192 if dev.startswith("cuda") else 256
        ids = torch.randint(0, model.cfg.vocab_size, (1, n_pre), device=dev, generator=g)
        with torch.no_grad():
            hf_ms = time_cuda(lambda: hf(ids, logits_to_keep=1), warmup=1, iters=3)
        ours = next((r["ms"] for r in prefill_rows if r["tokens"] == n_pre), None)
        sec["rows"].append({"what": f"prefill {n_pre} tokens", "hf_ms": hf_ms, "tandem_ms": ours,
                            "speedup": hf_ms / ours if ours else None})
        # batch-1 decode: HF's own cache, one token per forward
        prompt = ids[:, :min(512, n_pre)]
        with torch.no_grad():
            out = hf(prompt, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)

            def step():
                nonlocal cache, tok
                o = hf(tok, past_key_values=cache, use_cache=True)
                cache, tok = o.past_key_values, o.logits[:, -1:].argmax(-1)

            dec_ms = time_cuda(step, warmup=2, iters=10)
        ours_dec = next((r["ms_per_step"] for r in decode_rows if r.get("batch") == 1 and "ms_per_step" in r), None)
        sec["rows"].append({"what": "decode batch 1 (ms/token)", "hf_ms": dec_ms, "tandem_ms": ours_dec,
                            "speedup": dec_ms / ours_dec if ours_dec else None})
        # accuracy: top-1 agreement of our FP8 model with HF bf16 on the same weights
        n = 256
        with torch.no_grad():
            ref = hf(ids[:, :n]).logits[0].float()
        meta = build_step_meta([SeqStep(None, 0, n)], None, model.device)
        mine = model.compute_logits(model(ids[0, :n], meta, None))
        agree = (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rel = ((mine - ref).norm() / ref.norm()).item()
        sec["agreement"] = {"tokens": n, "top1_agreement": agree, "logits_rel_err": rel}
        print(f"HF peer: prefill 8k {hf_ms:.1f} ms vs {ours}; decode {dec_ms:.2f} ms vs {ours_dec}; "
              f"FP8 vs HF bf16 top-1 agreement {agree:.1%}, rel err {rel:.3f}", flush=True)
        del hf
        gc.collect()
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
