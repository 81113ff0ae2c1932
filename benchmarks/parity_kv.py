"""FP8 KV accuracy at real widths (the KV modes of benchmarks/parity_real.py), CPU or GPU.

--kv-dtypes: an fp32 gpt-oss with the preset's real widths and `--layers` layers (alternating
sliding/full, random weights: RandomSource, MXFP4 experts dequantised) prefills a random
`--context`-token prompt in `--chunk`-token steps and then decodes `--decode` further random
tokens one by one (teacher forcing: every configuration sees the same tokens), with its KV pages in
fp32 (the ground truth), bf16, FP8 e4m3 with the default scales (1.0) and FP8 with scales calibrated
on `--calibration` prompts. Only the KV dtype differs between runs: activations and weights are
fp32, attention is the torch reference (quantise on store, dequantise on read). Per configuration,
over the scored positions (the last prompt token and each decode step): logits relative error
against fp32 KV (Frobenius), the median of each position's relative error, max |dlogit|, top-1
agreement with fp32 KV, and FP8 against bf16 KV.

--kv-amax: max |K| (after RoPE) and max |V| per layer over the calibration passages
(engine/kv_calibration.py) for the tiny preset and the real-widths model: what an FP8 scale must
cover (e4m3 max 448; the default scale 1.0 covers |x| <= 448 with full precision down to 2^-6).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks.common import Results, environment, markdown_table, out_dir
from engine.build import EngineConfig, load_model
from engine.kv_calibration import calibration_prompts, measure_kv_amax
from model.context import SeqStep, build_step_meta
from model.kv_cache import KVManager, KVPool, SeqPages, plan_kv_cache
from model.kv_scales import KVScales

FP8 = torch.float8_e4m3fn


def _model(a: argparse.Namespace, preset: str, layers: int | None):
    return load_model(EngineConfig(random_preset=preset, random_layers=layers, device=a.device, dtype="float32"))


@torch.inference_mode()
def score(model, tokens: list[int], context: int, chunk: int, dtype: torch.dtype, scales: KVScales | None
          ) -> torch.Tensor:
    """Logits [1 + len(tokens) - context, V] fp32: the last context token's, then each decode step's."""
    spec = plan_kv_cache(model.cfg, 1 << 40, page_size=16, max_num_seqs=1, dtype=dtype)  # sized below
    need = -(-len(tokens) // 16) + 1
    spec = dataclasses.replace(spec, num_pages=(need, spec.ring_pages))
    pool, kv, pages = KVPool(spec, model.device, scales=scales), KVManager(spec), SeqPages()
    dev = model.device
    out = []
    pos = 0
    while pos < context:
        n = min(chunk, context - pos)
        kv.grow(pages, pos + n)
        meta = build_step_meta([SeqStep(pages, pos, n)], spec, dev)
        hidden = model(torch.tensor(tokens[pos:pos + n], device=dev), meta, pool)
        pos += n
    out.append(model.compute_logits(hidden[meta.logits_indices])[0])
    for pos in range(context, len(tokens)):
        kv.grow(pages, pos + 1)
        meta = build_step_meta([SeqStep(pages, pos, 1)], spec, dev)
        out.append(model.compute_logits(model(torch.tensor(tokens[pos:pos + 1], device=dev), meta, pool))[0])
    kv.release(pages)
    return torch.stack(out).float().cpu()


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor, ref_name: str) -> dict:
    d = got - ref
    per_pos = d.norm(dim=-1) / ref.norm(dim=-1)
    return {"kv": name, "vs": ref_name, "rel_err": (d.norm() / ref.norm()).item(),
            "median_pos_rel_err": per_pos.median().item(), "max_abs_dlogit": d.abs().max().item(),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def kv_dtypes(res: Results, a: argparse.Namespace) -> None:
    with res.section("kv_dtypes") as sec:
        model = _model(a, a.preset, a.layers)
        cfg = model.cfg
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.vocab_size, (a.context + a.decode,), generator=g).tolist()
        t0 = time.monotonic()
        k, v = measure_kv_amax(model, calibration_prompts(a.calibration, cfg.vocab_size))
        calibrated = KVScales.from_amax(k, v, f"calibrated:{a.calibration}")
        sec["calibrated_scales"] = {"k": calibrated.k.tolist(), "v": calibrated.v.tolist(),
                                    "k_amax": k.tolist(), "v_amax": v.tolist()}
        runs = {}
        for name, dtype, scales in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                    ("fp8", FP8, None), ("fp8-calibrated", FP8, calibrated)):
            t1 = time.monotonic()
            runs[name] = score(model, tokens, a.context, a.chunk, dtype, scales)
            print(f"[kv {name}] {a.context} + {a.decode} tokens in {time.monotonic() - t1:.0f} s", flush=True)
        sec["seconds_total"] = round(time.monotonic() - t0, 1)
        sec["rows"] = [_compare(n, runs[n], runs["fp32"], "fp32 KV") for n in ("bf16", "fp8", "fp8-calibrated")]
        sec["rows"] += [_compare(n, runs[n], runs["bf16"], "bf16 KV") for n in ("fp8", "fp8-calibrated")]
        sec["setup"] = {"preset": a.preset, "layers": a.layers, "context": a.context, "decode": a.decode,
                        "chunk": a.chunk, "positions_scored": a.decode + 1, "model_dtype": "float32",
                        "attention": "torch reference", "weights": "random (RandomSource seed 0)"}
        print(markdown_table(sec["rows"], ["kv", "vs", "rel_err", "median_pos_rel_err", "max_abs_dlogit",
                                           "top1_agreement"]), flush=True)


def kv_amax(res: Results, a: argparse.Namespace) -> None:
    with res.section("kv_amax") as sec:
        for label, preset, layers in (("tiny", "tiny", None), (f"{a.preset} widths, {a.layers} layers", a.preset,
                                                                 a.layers)):
            model = _model(a, preset, layers)
            k, v = measure_kv_amax(model, calibration_prompts(2, model.cfg.vocab_size))
            row = {"model": label, "k_amax": float(k.max()), "v_amax": float(v.max()),
                   "k_amax_per_layer": [round(float(x), 3) for x in k.amax(1)],
                   "v_amax_per_layer": [round(float(x), 3) for x in v.amax(1)],
                   "calibrated_k_scale": float(KVScales.from_amax(k, v, "c").k.max()),
                   "calibrated_v_scale": float(KVScales.from_amax(k, v, "c").v.max())}
            sec["rows"].append(row)
            print(row, flush=True)
            del model


def run(a: argparse.Namespace) -> None:
    torch.manual_seed(0)
    name = "parity_kv_amax" if a.kv_amax else f"parity_kv_{a.preset}_ctx{a.context}"
    res = Results(out_dir() / f"{name}.json", {"env": environment(), "args": vars(a)})
    (kv_amax if a.kv_amax else kv_dtypes)(res, a)
    res.save()
