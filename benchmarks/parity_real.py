"""Correctness at real dimensions on the GPU: our model (bf16, and FP8 128x128) against HF
transformers GptOssForCausalLM (bf16, eager) holding the same random weights, on one prompt.
Reports logits relative error and top-1 agreement per pair.

    python -m benchmarks.parity_real --preset gpt-oss-20b --tokens 512
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
    a = ap.parse_args()
    res = Results(out_dir() / f"parity_{a.preset}.json", {"env": environment(), "args": vars(a)})
    ids = torch.randint(0, 201088, (a.tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
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
    res.save()


if __name__ == "__main__":
    main()
