"""FP8 QKV/O accuracy at real widths, CPU or GPU: what issue 27 asks before FP8 attention projections could become
the workers' default ("measure and report its accuracy delta as for FP8 experts").

The preset's real widths with `--layers` layers (alternating sliding/full, random weights: RandomSource, MXFP4
experts) score one random `--tokens`-token prompt in a single forward (no KV cache: every position's logits). Rows:

  fp32          fp32 weights and activations, torch backends: the ground truth (the model matches HF transformers
                to fp32 rounding: docs/performance.md "Correctness at real widths")
  fp8-experts   the workers' default numerics: bf16 activations and attention projections, experts FP8 128x128
  fp8-qkvo      the same with the QKV / O projections FP8 128x128 too, their inputs quantised 1x128 to e4m3 as the
                GPU kernels do (kernels.fp8_gemm.TritonFp8Linear; the interpreter on a CPU)
  fp8w-qkvo     FP8 128x128 projection weights with bf16 inputs (weights dequantised: kernels.torch_backend's
                linear), the numerics a weight-only (W8A16) few-token kernel would have

The experts run on the torch MoE in both FP8 rows (weights dequantised, activations not quantised) so that the rows
differ only in the projections. Per row against fp32: logits relative error (Frobenius, all positions), the median of
each position's relative error, max |dlogit|, top-1 agreement; and fp8-qkvo against fp8-experts. Random weights:
this measures the numerics, not task accuracy (that needs the real checkpoint, which cannot be downloaded here).

    TRITON_INTERPRET=1 python -m benchmarks.parity_qkvo --device cpu --layers 2 --tokens 256
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.common import Results, environment, markdown_table, out_dir
from benchmarks.parity_real import logits_of
from engine.build import EngineConfig, load_model

ROWS = (  # name, dtype, fp8, fp8_attention, linear backend
    ("fp32", "float32", False, False, "torch"),
    ("fp8-experts", "bfloat16", True, False, "torch"),
    ("fp8-qkvo", "bfloat16", True, True, "triton"),
    ("fp8w-qkvo", "bfloat16", True, True, "torch"),
)


def logits(a: argparse.Namespace, dtype: str, fp8: bool, fp8_attention: bool, linear: str,
           ids: torch.Tensor) -> torch.Tensor:
    """[T, V] fp32 logits of every prompt position."""
    model = load_model(EngineConfig(random_preset=a.preset, random_layers=a.layers, device=a.device, dtype=dtype,
                                    fp8=fp8, fp8_attention=fp8_attention, linear_backend=linear,
                                    attention_backend="torch", moe_backend="torch"))
    out = logits_of(model, ids).cpu()
    del model
    gc.collect()
    return out


def compare(u: torch.Tensor, v: torch.Tensor) -> dict:
    """u against the reference v, both [T, V]."""
    per_pos = (u - v).norm(dim=-1) / v.norm(dim=-1)
    return {"rel_err": ((u - v).norm() / v.norm()).item(), "median_pos_rel_err": per_pos.median().item(),
            "max_abs_dlogit": (u - v).abs().max().item(),
            "top1_agreement": (u.argmax(-1) == v.argmax(-1)).float().mean().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=2, help="layers at real widths (sliding and full alternate)")
    ap.add_argument("--tokens", type=int, default=256, help="prompt positions scored")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    res = Results(out_dir() / f"parity_qkvo_{a.preset}.json", {"env": environment(), "args": vars(a)})
    ids = torch.randint(0, 201088, (a.tokens,), generator=torch.Generator().manual_seed(a.seed)).to(a.device)
    outs = {}
    for name, dtype, fp8, fp8_attention, linear in ROWS:
        t0 = time.perf_counter()
        outs[name] = logits(a, dtype, fp8, fp8_attention, linear, ids)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    with res.section("qkvo") as sec:
        for name, ref in (("fp8-experts", "fp32"), ("fp8-qkvo", "fp32"), ("fp8w-qkvo", "fp32"),
                          ("fp8-qkvo", "fp8-experts"), ("fp8w-qkvo", "fp8-experts")):
            sec["rows"].append({"model": name, "against": ref, "layers": a.layers, "positions": a.tokens,
                                **compare(outs[name], outs[ref])})
        print(markdown_table(sec["rows"], ["model", "against", "rel_err", "median_pos_rel_err", "max_abs_dlogit",
                                           "top1_agreement"]), flush=True)
    res.save()


if __name__ == "__main__":
    main()
