"""GPU suites of issue 27's one-token W8A16 FP8 projections (kernels/fp8_rows.py): merged into benchmarks/suites.py's
SUITES, whose docstring says how suites run and are added. Run 1 of rows-b1-ab (da4b902) also timed a one-token MoE on
the rows kernels (lost to kernels/moe_small.py, removed)."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.suite_defs import PYTEST, STACK_CARRY, Suite, step
from benchmarks.suites_issues import ISSUE_SUITES
from benchmarks.suites_served import SERVED_SUITES
from kernels.registry import DEFAULT_FUSIONS, Fusion, fusions_name, parse_fusions

D = fusions_name(parse_fusions(DEFAULT_FUSIONS) - {Fusion.FP8_ROWS})  # the defaults but fp8_rows
# The best batch-1 configuration measured before (issue27-h200-1's b1best: FP8 QKV/O, e4m3 pages, the few-token FP8
# projections), with the other default fusions, against the rows kernel (a default since rows-b1-ab-4) in its place.
FP8_ARMS = f"{D}+fp8_gemv,{D}+fp8_rows"

ROWS_SUITES: dict[str, Suite] = {
    "rows-b1-ab": Suite(
        "issue 27's one-token W8A16 FP8 projections (kernels/fp8_rows.py: x in bf16, FP8 weights dequantised in "
        "registers, whole rows per program, no split-K): its GPU tests (parity at 20b widths, bits under CUDA-graph "
        "replay, the model and graph decode), the micro-benchmark against today's one-token projections with weights "
        "from HBM (bf16 gemv rows, dense_small; a config sweep), then decode replay at 8k x 1 A/B in one process, FP8 "
        "QKV/O on e4m3 pages with fp8_gemv vs fp8_rows: gpt-oss-20b, then gpt-oss-120b (needs an H200's memory)",
        carry=STACK_CARRY,
        steps=(step("rows-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_rows_gpu.py",
                    150, summary=PYTEST),
               step("rows-micro", "{py} -m benchmarks.rows_b1", 60, summary=r"^o .*by K|wrote|Error"),
               step("model-20b-fp8-rows", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                          "--kv-cache-dtype fp8 --prefill-lens '' --contexts 8192 --batches 1 "
                                          f"--fusions {FP8_ARMS} --tag gpt-oss-20b-tp1-fp8-rows-ab", 70,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-fp8-rows-ab.json": "model_gpt-oss-20b-tp1-fp8-rows-ab.json"}),
               step("model-120b-fp8-rows", "{py} -m benchmarks.bench_model --preset gpt-oss-120b --linear deepgemm "
                                           "--kv-cache-dtype fp8 --prefill-lens '' --contexts 8192 --batches 1 "
                                           f"--fusions {FP8_ARMS} --tag gpt-oss-120b-tp1-fp8-rows-ab", 150,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-120b-tp1-fp8-rows-ab.json": "model_gpt-oss-120b-tp1-fp8-rows-ab.json"})),
        reproduces=("issue27-h200-1 (2026-12-06, H200): 20b 8k x 1 replay 2.110 ms with FP8 QKV/O + fp8_gemv on e4m3 "
                    "pages (b1best); rows-b1-ab-1 (H100): 2.461 ms for the same, 2.778 with fp8_rows' first tiles",)),
    # An experiment, any card: how much of MXFP4's halved bytes a one-token MoE turns into time, alone and in the model
    "mxfp4-b1": Suite(
        "issue 27's one-token MoE on the checkpoint's MXFP4 experts (kernels/moe_mxfp4.py, W4A16 on the CUDA cores, "
        "Fusion.MXFP4_MOE with EngineConfig.mxfp4_experts): its GPU tests (parity at 20b widths against the "
        "dequantised fp32 reference, bits under CUDA-graph replay, a 2-layer model and its graph decode), the "
        "micro-benchmark against kernels/moe_small.py on the same experts in FP8 (model.quant.mxfp4_to_fp8), weights "
        "from HBM, with a config sweep and each kernel's device time from HBM and from L2, then the 20b decode replay "
        "at 8k x 1 A/B in one process on the best batch-1 configuration (FP8 QKV/O, e4m3 pages, the default fusions) "
        "with and without mxfp4_moe (its f16x2 LOP3 form)",
        carry=STACK_CARRY,
        steps=(step("mxfp4-gpu-tests",
                    "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_moe_mxfp4_gpu.py", 180,
                    summary=PYTEST),
               step("mxfp4-micro", "{py} -m benchmarks.moe_mxfp4_b1 --kernels", 100,
                    summary=r"^(fp8|mxfp4 rows 8/8 x 32 groups w4 s3 pdl|mxfp4 .* f16_\w+|kernel )|wrote|Error"),
               step("model-20b-mxfp4", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                       "--kv-cache-dtype fp8 --prefill-lens '' --contexts 8192 --batches 1 "
                                       f"--fusions {DEFAULT_FUSIONS},{DEFAULT_FUSIONS}+mxfp4_moe "
                                       "--mxfp4-dot f16_lop --tag gpt-oss-20b-tp1-mxfp4-ab", 90,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-mxfp4-ab.json": "model_gpt-oss-20b-tp1-mxfp4-ab.json"})),
        reproduces=("issue27-h200-1 (2026-12-06, H200): the 20b MoE at one token 25.5 + 13.0 us a layer in the model "
                    "(0.61 of copy); rows-b1-ab-1 (H100): 46.5 us alone with weights from HBM; rows-b1-ab-4 (H100): "
                    "20b 8k x 1 replay 2.350 ms with FP8 QKV/O on e4m3 pages and fp8_rows",)),
}

# The GPU tests of the shared CUDA-graph capture (tests/support/cuda_graph.py) and of the offline engine's own decode
# graphs (EngineConfig.cuda_graphs, engine/decode_graphs.py): 17 tests
_GRAPH_TEST_CMD = ("{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_gpu.py "
                   "tests/kernels/test_dense_small_gpu.py tests/kernels/test_fp8_kv_gpu.py "
                   "tests/kernels/test_fp8_rows_gpu.py tests/kernels/test_sampling_gpu.py "
                   "tests/kernels/test_fusion_gpu.py tests/integration/test_async_decode_gpu.py "
                   "tests/integration/test_prompt_logprobs_gpu.py "
                   "-k 'cuda_graph or graph or triton_decode_backend_on_bf16 or async_decode or prompt_logprobs'")
# FlashInfer's plan runs with tensor_max (kernels/flashinfer_host.patch_tensor_max), the default since
# graphed-default-check-1 (TANDEM_FI_TENSOR_MAX=1 was this step's opt-in before)
GRAPH_TESTS = step("graph-capture-gpu-tests", _GRAPH_TEST_CMD, 200, summary=PYTEST)
PLAN_HOST = step("plan-host", "{py} -m benchmarks.plan_host", 60, summary=r"^plan |wrote|Error")
# the piecewise GPU tests: graphed modes against eager Triton without split-KV
PIECEWISE_GPU_TESTS = step("piecewise-gpu-tests", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                           "tests/integration/test_piecewise_gpu.py", 150, summary=PYTEST)  # 4 engines: >100 s fresh
# the graphed attention's split-KV at long context against the same launches unsplit and FlashInfer fa2
GRAPH_ATTN_LONG = step("graph-attn-long", "{py} -m benchmarks.graph_attention_long", 60,
                       summary=r"^long |wrote|FAILED|Error")
ROWS_SUITES["graph-tests"] = Suite(
    "the GPU tests of the shared CUDA-graph capture helper (tests/support/cuda_graph.py) and of the offline engine's "
    "own decode graphs (EngineConfig.cuda_graphs): attention, FP8 KV, the few-token kernels, sampling, the fused "
    "model's graph decode, the overlapped loop and prompt logprobs with graphs; then the host time of a decode step's "
    "attention plan with FlashInfer's max() over host tensors as shipped and shadowed by tensor_max "
    "(benchmarks/plan_host.py); the graphed attention's split-KV at long context (benchmarks/graph_attention_long.py); "
    "the piecewise GPU tests, graphed modes judged against eager Triton without split-KV",
    carry=STACK_CARRY,
    steps=(GRAPH_TESTS, PLAN_HOST, GRAPH_ATTN_LONG, PIECEWISE_GPU_TESTS))

# What waits for an H200, in one device call, most wanted first (a step the --budget cannot fit is skipped): issue 25's
# colocated A/B with attention in the graphs for small steps; issue 27's figures with today's defaults (20b prefill 8k
# and 8k x 1 / x 64, 120b) and the FP8-projection A/B on 20b and 120b, the 20b decode profile; then the GPU tests whose
# CUDA-graph capture moved to tests/support/cuda_graph.py.
_GRAPHED = SERVED_SUITES["issue25-h200-graphed"]
_ISSUE27 = {s.name: s for s in ISSUE_SUITES["issue27-h200"].steps}
_ROWS = {s.name: s for s in ROWS_SUITES["rows-b1-ab"].steps}
_MXFP4 = {s.name: s for s in ROWS_SUITES["mxfp4-b1"].steps}
ROWS_SUITES["h200-next"] = Suite(
    "what waits for an H200, one call: " + _GRAPHED.description + "; then issue 27's figures with the workers' "
    "defaults (issue27-h200's model-20b and model-120b), the FP8-projection A/B of rows-b1-ab on 20b and 120b, the "
    "20b decode profile, the 20b 8k x 1 A/B with and without mxfp4_moe (mxfp4-b1's model step). The piecewise GPU "
    "tests moved to any-card-next: the call's 560 s are spent",
    carry=STACK_CARRY,
    # timeouts cut to fit one call, from what the steps took on the H200 (issue27-h200-1: model-20b 12 s, model-120b
    # 20 s, profile-20b 17 s; issue25-h200-1: ~140 s an arm)
    # the MXFP4 A/B after the figures it would change (on an H200 it is issue 27's figure when it wins)
    steps=_GRAPHED.steps + (replace(_ISSUE27["model-20b"], timeout_s=30),
                            replace(_ROWS["model-20b-fp8-rows"], timeout_s=30),
                            replace(_ISSUE27["model-120b"], timeout_s=40),
                            replace(_ROWS["model-120b-fp8-rows"], timeout_s=40),
                            replace(_ISSUE27["profile-20b"], timeout_s=30),
                            replace(_MXFP4["model-20b-mxfp4"], timeout_s=60)),
    reproduces=_GRAPHED.reproduces + ISSUE_SUITES["issue27-h200"].reproduces + ROWS_SUITES["rows-b1-ab"].reproduces)

# The same evidence for the graphed-attention default on any card (an H100 when no H200 comes): issue 25's colocated
# A/B (islands vs attention in the graphs for steps <= 768 tokens), the split-KV at long context, the piecewise GPU
# tests (graphed modes against eager Triton without split-KV), the graph capture tests and plan-host.
ROWS_SUITES["graphed-default-check"] = Suite(
    "evidence for attention inside the piecewise graphs as a GPU decode worker's default, on any card: "
    + _GRAPHED.description + "; the graphed split-KV at long context against unsplit and FlashInfer fa2; the piecewise "
    "GPU tests (with e4m3 pages since run 1); the graph capture GPU tests with FlashInfer's plan on tensor_max "
    "(plan-host, in run 1, stays in graph-tests: the piecewise tests' fourth engine took its seconds)",
    carry=STACK_CARRY,
    steps=_GRAPHED.steps + (GRAPH_ATTN_LONG, replace(PIECEWISE_GPU_TESTS, timeout_s=100),
                            replace(GRAPH_TESTS, timeout_s=100)),
    reproduces=_GRAPHED.reproduces)

# What waits for any card, in one device call (a step the --budget cannot fit is skipped): the MXFP4 experiment first
# (all of it runs on an H100 too: A/Bs in one process), then the piecewise GPU tests for the e4m3 engine under its
# revised bound (graph-tests-4's miss; a pass lets e4m3 pages take attention inside the graphs by default).
ROWS_SUITES["any-card-next"] = Suite(
    "what waits for any card, one call: " + ROWS_SUITES["mxfp4-b1"].description + "; then the piecewise GPU tests "
    "(graphed modes against eager Triton without split-KV, bf16 and e4m3 pages)",
    carry=STACK_CARRY,
    # the piecewise tests' four engines ran past 150 s on the H100 (any-card-next-1: the e4m3 engine at its T=17)
    steps=(replace(ROWS_SUITES["mxfp4-b1"].steps[0], timeout_s=150),) + ROWS_SUITES["mxfp4-b1"].steps[1:]
    + (replace(PIECEWISE_GPU_TESTS, timeout_s=210),),
    reproduces=ROWS_SUITES["mxfp4-b1"].reproduces + ("graph-tests-4 (2026-12-07, H100): all-e4m3 0.034 from eager "
                                                     "Triton at T=1, the two eager backends 0.039 apart",))

# One H200 call for both open issues when only one may come: issue 25's colocated run with the decode worker's
# default (attention inside the piecewise graphs, with and without prefix caching: the issue's ratio on its card),
# then the MXFP4 experiment of issue 27 (its GPU tests, the micro-benchmark with the f16x2 form in the sweep, the 20b
# 8k x 1 A/B). On another card, any-card-next instead (the device call chooses by nvidia-smi).
_GRAPHED_STEPS = {s.name: s for s in _GRAPHED.steps}
ROWS_SUITES["h200-25-27"] = Suite(
    "issue 25's colocated multi-turn run with the decode worker's defaults (attention inside the piecewise graphs "
    "for steps <= 768 tokens; 64 x 8 turns, ONE decode worker, with and without prefix caching), then "
    + ROWS_SUITES["mxfp4-b1"].description,
    carry=STACK_CARRY,
    steps=(_GRAPHED_STEPS["colocated-1-graphed768"],) + ROWS_SUITES["mxfp4-b1"].steps,
    reproduces=_GRAPHED.reproduces + ROWS_SUITES["mxfp4-b1"].reproduces)
