"""GPU suites of issue 27's one-token W8A16 kernels (kernels/fp8_rows.py, kernels/moe_rows.py): merged into
benchmarks/suites.py's SUITES, whose docstring says how suites run and are added."""

from __future__ import annotations

from benchmarks.suite_defs import PYTEST, STACK_CARRY, Suite, step
from kernels.registry import DEFAULT_FUSIONS

D = DEFAULT_FUSIONS
# The best batch-1 configuration measured before (issue27-h200-1's b1best: FP8 QKV/O, e4m3 pages, the few-token FP8
# projections), with today's default fusions, against the rows kernels in its place and for the MoE too.
FP8_ARMS = f"{D}+fp8_gemv,{D}+fp8_rows,{D}+fp8_rows+moe_rows"

ROWS_SUITES: dict[str, Suite] = {
    "rows-b1-ab": Suite(
        "issue 27's one-token W8A16 kernels (x and the MoE's act in bf16, FP8 weights dequantised in registers, whole "
        "rows per program, no split-K): their GPU tests (parity at 20b widths, bits under CUDA-graph replay, EP, the "
        "model and graph decode), the micro-benchmark against today's one-token kernels with weights from HBM (bf16 "
        "gemv rows, dense_small, moe_small; a config sweep), then gpt-oss-20b decode replay at 8k x 1 A/B in one "
        "process: the defaults vs +moe_rows (bf16 QKV/O), and FP8 QKV/O on e4m3 pages with fp8_gemv vs fp8_rows vs "
        "fp8_rows+moe_rows; last gpt-oss-120b at 8k x 1, the defaults vs +moe_rows (needs an H200's memory)",
        carry=STACK_CARRY,
        steps=(step("rows-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_rows_gpu.py",
                    150, summary=PYTEST),
               step("rows-micro", "{py} -m benchmarks.rows_b1", 90, summary=r"^moe 20b|wrote|Error"),
               step("model-20b-moe-rows", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                          f"--prefill-lens '' --contexts 8192 --batches 1 --fusions {D},{D}+moe_rows "
                                          "--tag gpt-oss-20b-tp1-moe-rows-ab", 70, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-moe-rows-ab.json": "model_gpt-oss-20b-tp1-moe-rows-ab.json"}),
               step("model-20b-fp8-rows", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                          "--kv-cache-dtype fp8 --prefill-lens '' --contexts 8192 --batches 1 "
                                          f"--fusions {FP8_ARMS} --tag gpt-oss-20b-tp1-fp8-rows-ab", 80,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-fp8-rows-ab.json": "model_gpt-oss-20b-tp1-fp8-rows-ab.json"}),
               step("model-120b-moe-rows", "{py} -m benchmarks.bench_model --preset gpt-oss-120b --bf16-attention "
                                           f"--prefill-lens '' --contexts 8192 --batches 1 --fusions {D},{D}+moe_rows "
                                           "--tag gpt-oss-120b-tp1-moe-rows-ab", 150, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-120b-tp1-moe-rows-ab.json": "model_gpt-oss-120b-tp1-moe-rows-ab.json"})),
        reproduces=("issue27-h200-1 (2026-12-06, H200): 20b 8k x 1 replay 2.146 ms (defaults), 2.110 (b1best); "
                    "norm-quant-b1-ab-1: 2.091 with norm_quant",)),
}
