"""Correctness at real dimensions on the GPU: our model (bf16, and FP8 128x128) against HF
transformers GptOssForCausalLM (bf16, eager) holding the same random weights, on one prompt.
Reports logits relative error and top-1 agreement per pair.

    python -m benchmarks.parity_real --preset gpt-oss-20b --tokens 512

KV-dtype mode (CPU or GPU; benchmarks/parity_kv.py): the fp32 model at real widths with few layers
scores the same context + continuation with fp32, bf16 and FP8 (e4m3) KV pages:

    python -m benchmarks.parity_real --kv-dtypes --device cpu --layers 2 --context 8192 --decode 32
    python -m benchmarks.parity_real --kv-amax --device cpu       # K/V amax: tiny and real-dims models
"""

from __future__ import annotations

import argparse
import gc

import torch

from benchmarks.common import Results, environment, out_dir
from benchmarks.hf_peer import build_hf
from engine.build import EngineConfig, load_model
from model.context import SeqStep, build_step_meta


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    meta = build_step_meta([SeqStep(None, 0, ids.numel())], None, model.device)
    with torch.inference_mode():
        return model.compute_logits(model(ids, meta, None)).float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--attention", default="triton")
    ap.add_argument("--fp32-layers", type=int, default=2,
                    help="also check an N-layer model at real widths in fp32 against HF fp32 (0 = skip)")
    ap.add_argument("--skip-full", action="store_true", help="skip the full-depth bf16 comparison")
    ap.add_argument("--kv-dtypes", action="store_true", help="FP8 / bf16 / fp32 KV pages (benchmarks/parity_kv.py)")
    ap.add_argument("--kv-amax", action="store_true", help="max |K|, |V| the random models reach (FP8 KV scales)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=2, help="KV modes: layers at real widths (1 sliding + 1 full...)")
    ap.add_argument("--context", type=int, default=8192, help="--kv-dtypes: context tokens before the scored ones")
    ap.add_argument("--decode", type=int, default=32, help="--kv-dtypes: teacher-forced decode steps scored")
    ap.add_argument("--chunk", type=int, default=256, help="--kv-dtypes: prefill chunk (bounds attention memory)")
    ap.add_argument("--calibration", type=int, default=1, help="--kv-dtypes: prompts for the calibrated FP8 row")
    a = ap.parse_args()
    if a.kv_dtypes or a.kv_amax:
        from benchmarks.parity_kv import run
        run(a)
        return
    res = Results(out_dir() / f"parity_{a.preset}.json", {"env": environment(), "args": vars(a)})
    ids = torch.randint(0, 201088, (a.tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    if not a.skip_full:
        full_section(res, a, ids)
    if a.fp32_layers:
        fp32_section(res, a, ids)
    res.save()


def full_section(res: Results, a: argparse.Namespace, ids: torch.Tensor) -> None:
    with res.section("parity") as sec:
        hf = build_hf(a.preset)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        outs = {}
        for name, fp8, linear in (("tandem_bf16", False, "torch"), ("tandem_fp8", True, "scaled_mm")):
            m = load_model(EngineConfig(random_preset=a.preset, device="cuda", dtype="bfloat16", fp8=fp8,
                                        attention_backend=a.attention, linear_backend=linear, moe_backend="triton"))
            outs[name] = logits_of(m, ids)
            del m
            gc.collect()
            torch.cuda.empty_cache()
        outs["hf_bf16"] = ref

        def cmp(x: str, y: str) -> dict:
            u, v = outs[x], outs[y]
            return {"a": x, "b": y, "rel_err": ((u - v).norm() / v.norm()).item(),
                    "top1_agreement": (u.argmax(-1) == v.argmax(-1)).float().mean().item()}

        sec["rows"] = [cmp("tandem_bf16", "hf_bf16"), cmp("tandem_fp8", "hf_bf16"), cmp("tandem_fp8", "tandem_bf16")]
        for r in sec["rows"]:
            print(f"{r['a']:>12} vs {r['b']:<12} rel err {r['rel_err']:.4f}  top-1 agreement {r['top1_agreement']:.1%}",
                  flush=True)


def fp32_section(res: Results, a: argparse.Namespace, ids: torch.Tensor) -> None:
    """Real widths, few layers, fp32: the model must match HF to fp32 rounding; then how far each
    bf16 / FP8 configuration (ours and HF's) lands from that fp32 ground truth."""
    import dataclasses

    from model.config import preset

    cfg = dataclasses.replace(preset(a.preset), num_hidden_layers=a.fp32_layers, layer_types=())
    with res.section("fp32_real_widths") as sec:
        hf = build_hf(cfg, dtype=torch.float32)
        with torch.no_grad():
            outs = {"hf_fp32": hf(ids[None]).logits[0].float()}
            hf.to(torch.bfloat16)
            outs["hf_bf16"] = hf(ids[None]).logits[0].float()
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        for name, dtype, fp8, att, lin, moe in (("tandem_fp32_torch", "float32", False, "torch", "torch", "torch"),
                                                ("tandem_bf16_kernels", "bfloat16", False, a.attention, "torch", "triton"),
                                                ("tandem_fp8_kernels", "bfloat16", True, a.attention, "scaled_mm", "triton")):
            m = load_model(EngineConfig(random_preset=a.preset, random_layers=a.fp32_layers, device="cuda", dtype=dtype,
                                        fp8=fp8, attention_backend=att, linear_backend=lin, moe_backend=moe))
            outs[name] = logits_of(m, ids)
            del m
            gc.collect()
            torch.cuda.empty_cache()
        ref = outs["hf_fp32"]
        for name, v in outs.items():
            row = {"model": name, "layers": a.fp32_layers, "rel_err_vs_hf_fp32": ((v - ref).norm() / ref.norm()).item(),
                   "top1_agreement": (v.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                   "max_abs_err": (v - ref).abs().max().item()}
            sec["rows"].append(row)
            print(f"[{a.fp32_layers} layers, real widths] {name:>20} vs hf_fp32: rel err {row['rel_err_vs_hf_fp32']:.2e} "
                  f"top-1 {row['top1_agreement']:.1%}", flush=True)


if __name__ == "__main__":
    main()
