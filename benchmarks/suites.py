"""GPU suites: every GPU run is a named suite of steps (benchmarks with their flags, GPU test files,
smoke runs of workers), run by one entry point that sets the machine up, gives each step its own
timeout, and records what ran (benchmarks/suite_run.py):

    tandem bench suite NAME [--out DIR] [--tar]     # on the GPU machine (through the device tool)
    tandem bench suite --list                       # suites, steps, budgets, what each reproduces
    tandem bench suite NAME --device-call           # here: the exact device-tool call for NAME

The device tool copies the repository; what the machine lacks travels in ignored folders named in
`carry` (fetch them once here: `python -m benchmarks.gpu_carry` -> .whl-site, the whole served stack's packages
in 23 MiB, which most suites carry; scripts/fetch_gpu_wheels.sh + scripts/fetch_deepgemm_wheel.sh -> .whl,
scripts/fetch_nixl_wheel.sh -> .whl-nixl, scripts/pack_deepgemm_carry.sh -> .cache/dgcarry; .cache/fi
holds flashinfer-cache.tar.xz from an earlier `kernels` run, kernels/attention/ in its tarball, or built ahead
here (`python -m benchmarks.flashinfer_cache --prebuild`: the FP8-KV modules, which the H200 never built), which
spares the FlashInfer JIT builds, ~2 min). A carried path that is missing here is left out there, and
the suite records what its set-up found. The call, e.g. for `model`:

    run(kind="nvidia-h200", timeout_s=600, carry=[".whl", ".cache/dgcarry", ".cache/fi"],
        command="TANDEM_GIT_COMMIT=<sha> TANDEM_GIT_DIRTY=0 python3 -m launcher.cli bench suite model --out $OUT/model --tar")

(`--device-call` prints it with the commit filled in, since the device copy need not hold .git, and
the carried sizes against the call's 64 MiB.) `--tar` leaves one
file, $OUT/model.tgz (the tool returns at most 8 files); unpack it into benchmarks/results/DATE/ and
run `tandem bench report`. A suite must fit one device call (600 s, set-up included): the sum of its
step timeouts stays under SUITE_BUDGET_S (tests/unit/test_suites.py checks it).

Adding a suite is a few lines: `SUITES["name"] = Suite(description, carry, steps=(step(...), ...))`.
In a step's command `{py}` is the interpreter and `{out}` the step's own output folder (also $OUT for
the step, where the benchmarks write their JSON); `publish` names the JSON files the results report
reads, as the report names them (e.g. gemm.json -> kernels_gemm.json).
Step, Suite and the step builders several suites share live in benchmarks/suite_defs.py.
"""

from __future__ import annotations

import shlex

from benchmarks.suite_defs import (FUSION_AB, MT_SERVE_ARGS, PYTEST, SERVED_ARGS, SERVED_MODEL_JSON,  # noqa: F401
                                   STACK_CARRY, SUITE_BUDGET_S, TP, Step, Suite, model_step, multi_turn_step, smoke_step, step,
                                   sweep_step)  # Step, Suite, SUITE_BUDGET_S: re-exported for suite_run and tests
from benchmarks.suites_issues import ISSUE_SUITES
from benchmarks.suites_rows import ROWS_SUITES
from benchmarks.suites_served import SERVED_SUITES

# The prefill worker's engine alone (benchmarks/prefill_prefix.py) with the multi-turn suite's prefill settings.
SUITES: dict[str, Suite] = {
    "kernels": Suite(
        "attention, FP8 GEMM and MoE kernel benchmarks, each with parity at real dims and the ceilings of the run",
        carry=(".whl", ".cache/dgcarry", ".cache/fi"),
        steps=(step("attention", "{py} -m benchmarks.attention", 200, summary=r"target|TFLOP/s",
                    publish={"attention.json": "kernels_attention.json"}),
               step("gemm", "{py} -m benchmarks.gemm --quick --clock", 150, summary=r"targets|8192",
                    publish={"gemm.json": "kernels_gemm.json"}),
               step("moe", "{py} -m benchmarks.moe --quick", 170, summary=r"targets|8192",
                    publish={"moe.json": "kernels_moe.json"})),
        reproduces=("2026-11-30/kernels_attention.json", "2026-12-01/kernels_moe.json (DG11)",
                    "2026-12-01/dg16/gemm.json (the quick sweep; `gemm-sweep` for kernels_gemm.json)")),
    "gemm-sweep": Suite(
        "the full FP8 GEMM sweep (M = 1..16k, every backend)", carry=(".whl", ".cache/dgcarry"),
        steps=(step("gemm", "{py} -m benchmarks.gemm --clock", 400, summary=r"targets|8192",
                    publish={"gemm.json": "kernels_gemm.json"}),),
        reproduces=("2026-12-01/kernels_gemm.json (DG14)",)),
    "moe-profile": Suite(
        "where the 20b MoE layer's time goes, per kernel, at 1 and 8192 tokens (the workers' backend)",
        carry=(".whl", ".cache/dgcarry"),
        steps=(step("moe-profile", "{py} -m benchmarks.moe --profile 1,8192", 200, summary=r"^profile"),),
        reproduces=("2026-12-01/dg11/diag_dg11.log (layer profile)", "2026-12-01/dg4/profile.log")),
    "model": Suite(
        "gpt-oss-20b and -120b on one H200 with the workers' defaults: prefill, decode (CUDA graphs), HF peer",
        carry=(".whl", ".cache/dgcarry", ".cache/fi"),
        steps=(model_step("model-20b", "gpt-oss-20b", "2048,8192,32768", "8192", "1,32,128", 330, "--hf-peer"),
               model_step("model-120b", "gpt-oss-120b", "8192", "8192", "1,32", 170)),
        reproduces=("2026-12-01/dg10_dg10-20b-moe_deepgemm.json", "2026-12-01/dg10_dg10-120b-moe_deepgemm.json",
                    "2026-11-30/model_gpt-oss-20b-tp1.json (hf_peer)")),
    "model-tp2": Suite(
        "gpt-oss-120b and -20b over two H200s (attention TP2, MoE EP2, one-shot all-reduce up to 1 MiB)",
        carry=(".whl", ".cache/fi"), kind="nvidia-h200-x2",
        steps=(step("tp2-120b", f"{TP} --preset gpt-oss-120b --moe-mode ep --skip-allreduce --fast-allreduce-kib 1024 "
                                "--prefill-lens 8192 --contexts 8192 --batches 1,8,64,128", 260,
                    summary=r"^decode|^prefill", gpus=2, publish={
                        "model_gpt-oss-120b-tp2-ep-oneshot1024k.json": "model_gpt-oss-120b-tp2-ep-oneshot1024k.json"}),
               step("tp2-20b", f"{TP} --preset gpt-oss-20b --moe-mode ep --fast-allreduce-kib 1024 "
                               "--prefill-lens 8192 --contexts 8192 --batches 1,64,128", 220,
                    summary=r"^decode|^prefill|^all-reduce", gpus=2, publish={
                        "model_gpt-oss-20b-tp2-ep-oneshot1024k.json": "model_gpt-oss-20b-tp2-ep-oneshot1024k.json"})),
        reproduces=("2026-12-01/i_model_gpt-oss-120b-tp2-ep-oneshot1024k.json", "2026-12-01/i_model_gpt-oss-20b-tp2-ep.json")),
    "gpu-tests": Suite(
        "the GPU-marked kernel test files (GEMM/MoE incl. DeepGEMM, attention incl. FlashInfer)",
        carry=(".whl", ".cache/dgcarry", ".cache/fi"),
        steps=(step("gemm-moe", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemm_moe_gpu.py", 260,
                    summary=PYTEST),
               step("attention", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_gpu.py", 280,
                    summary=PYTEST)),
        reproduces=("2026-12-01/dg18/gpu_tests.log (33 passed)", "2026-12-01/p_attention_gpu.log (19 passed)")),
    "gpu-tests-x2": Suite(
        "the GPU tests that need two GPUs: our one-shot all-reduce, the IPC KV data path GPU0 -> GPU1",
        carry=(".whl-nixl",), kind="nvidia-h200-x2",
        steps=(step("two-gpu", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_allreduce.py "
                               "tests/integration/test_kv_transfer_ipc_gpu.py", 240, summary=PYTEST, gpus=2),)),
    "disagg-smoke": Suite(
        "disaggregated == colocated greedy tokens on one GPU (prefill and decode workers on cuda:0, KV over the "
        "IPC data path), the default path and FP8 QKV/O on DeepGEMM; every page back",
        carry=(".whl-nixl", ".cache/dgcarry"),
        steps=(smoke_step("default"), smoke_step("fp8attn", "--fp8-attention on --linear-backend deepgemm")),
        reproduces=("2026-12-01/dg15/disagg_smoke_default.json", "2026-12-01/dg15/disagg_smoke_fp8attn.json")),
    "disagg-smoke-fi": Suite(
        "disaggregated == colocated greedy tokens on one GPU with FlashInfer attention (the GPU default; disagg-smoke "
        "runs Triton's): prefill and decode workers on cuda:0, KV over the IPC data path; every page back",
        carry=STACK_CARRY,
        steps=(smoke_step("flashinfer", "--attention-backend flashinfer", timeout_s=170),)),
    "kv-transfer": Suite(
        "KV transfer of a 120b-shaped KV between two processes on one H200: copy_, NIXL and the IPC data path into "
        "contiguous / 16-page-run / scattered decode pages, alone and overlapped with a stand-in prefill",
        carry=(".whl-nixl",),
        steps=(step("kv-transfer", "{py} -m benchmarks.kv_transfer --devices cuda:0 cuda:0 --iters 3 --nixl-timeout 160",
                    380, summary=r"wrote|ERROR"),  # not published: the report's KV targets are GPU0 -> GPU1
               step("ipc-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_kv_transfer_ipc_gpu.py",
                    120, summary=PYTEST)),
        reproduces=("2026-12-01/ipc1/kv_transfer_1gpu.json",)),
    "kv-transfer-x2": Suite(
        "KV transfer GPU0 -> GPU1 (the 300 GB/s target): copy_ p2p, NIXL, the IPC data path",
        carry=(".whl-nixl",), kind="nvidia-h200-x2",
        steps=(step("kv-transfer", "{py} -m benchmarks.kv_transfer --iters 3 --nixl-timeout 200", 420,
                    summary=r"wrote|ERROR", publish={"kv_transfer.json": "x2_kv_transfer.json"}, gpus=2),),
        reproduces=("2026-11-30/x2_kv_transfer.json",)),
    "parity": Suite(
        "numerics at real widths: 2 layers in fp32 against HF transformers, and the full depth in bf16 / FP8",
        carry=(".whl",),
        steps=(step("parity", "{py} -m benchmarks.parity_real", 240, summary=r"rel|agreement|Error",
                    publish={"parity_gpt-oss-20b.json": "parity_gpt-oss-20b.json"}),),
        reproduces=("2026-12-01/n_parity_gpt-oss-20b.json",)),
    "served-engine": Suite(
        "the overlapped decode loop on the H200: its GPU tests (greedy == synchronous loop, no host sync at launch, "
        "seeded sampling) and bench_model's engine loop next to graph replay (20b, contexts 2k/8k, batch 1/64/128); "
        "saves FlashInfer's built modules to $OUT/fi for the next call",
        carry=STACK_CARRY,
        steps=(step("async-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider "
                                       "tests/integration/test_async_decode_gpu.py", 200, summary=PYTEST),
               model_step("model-20b", "gpt-oss-20b", "8192", "2048,8192", "1,64,128", 280),
               step("fi-save", "{py} -m benchmarks.flashinfer_cache --save {out}/../../fi", 60, summary=r"modules")),
        reproduces=("issue 23: ms_per_step <= 1.05 x graph replay at batch 1 and 128",)),
    "served-stack": Suite(
        "the whole stack served on ONE H200 (router + workers as real processes, 20b random weights): colocated "
        "and disaggregated (two processes sharing the GPU, KV over the IPC data path); single stream, a Poisson "
        "sweep (1k-8k in, 256-1k out), saturation at batch 64; against bench_model of served-engine",
        carry=STACK_CARRY,
        steps=(step("serve", "{py} -m benchmarks.serve_gpu --model-json " + SERVED_MODEL_JSON + " --out {out}/serve_gpu.json "
                             "--rates 1,2,4,8,16 --num-requests 24 --serve-args " + shlex.quote(SERVED_ARGS),
                    540, summary=r"single|sat|@|Error|Traceback"),)),
    "prompt-logprobs-gpu": Suite(
        "prompt logprobs (completions' echo + logprobs) on the GPU: the decode worker's setting (256-token chunks, "
        "piecewise and decode CUDA graphs, the overlapped loop, prefix caching) against an unchunked eager engine, "
        "20b widths, 2 random layers; bound relative to the same comparison with targets shifted by one",
        carry=STACK_CARRY,
        steps=(step("prompt-logprobs-gpu", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                           "tests/integration/test_prompt_logprobs_gpu.py", 150, summary=PYTEST),)),
    "served": Suite(
        "issue 23 in one call: the overlapped loop's GPU tests, bench_model's engine loop against graph replay "
        "(20b, 2k/8k x 1/64/128), and the whole stack served on this GPU against those figures (colocated and "
        "disaggregated: single stream, Poisson sweep 1-16 req/s, steady-state saturation at batch 64)",
        carry=STACK_CARRY,
        steps=(step("async-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider "
                                       "tests/integration/test_async_decode_gpu.py", 110, summary=PYTEST),
               model_step("model-20b", "gpt-oss-20b", "8192", "2048,8192", "1,64,128", 150),
               step("serve", "{py} -m benchmarks.serve_gpu --model-json "
                             "{out}/../model-20b/model_gpt-oss-20b-tp1-defaults.json --out {out}/serve_gpu.json "
                             "--rates 1,2,4,8,16 --num-requests 24 --serve-args " + shlex.quote(SERVED_ARGS),
                    290, summary=r"single|sat|@|Error|Traceback",
                    publish={"serve_gpu.json": "serve_gpt-oss-20b-h200.json"})),
        reproduces=("issue 23: ms_per_step <= 1.05 x replay; served single-stream ITL <= 1.10 x replay; "
                    "saturation >= 0.90 x bench_model",)),
    **ISSUE_SUITES,  # benchmarks/suites_issues.py: issues 26-27 (FP8 KV, kernels) and issue 25's kernel side
    **ROWS_SUITES,  # benchmarks/suites_rows.py: issue 27's one-token W8A16 kernels
    **SERVED_SUITES,  # benchmarks/suites_served.py: issue 25's served path (multi-turn, mixed steps, the hold)
    # issue 28: the embedded demo model. Training needs torch only; the data is rendered by openai-harmony,
    # which the GPU machine lacks: it travels in .whl-site. The sweep stops its runs by 225 s (up to 3.5 min of
    # training each, 6 at once, less when the data takes long; 55 s kept for start-up and evaluation), so the
    # step fits a short device budget.
    "demo-train": Suite(
        "the embedded demo model (issue 28): training.sweep renders the synthetic Harmony data once, trains 6 "
        "configurations/seeds of the tiny gpt-oss as concurrent processes on this GPU (up to 3.5 min each, all "
        "done 225 s after the start), evaluates each by greedy decoding (structure, exact answers, the integration "
        "tests' conversations) and by sampling, and "
        "leaves the best as gpt-oss-tiny-demo.safetensors (copy it to model/demo/)",
        carry=(".whl-site",),
        steps=(sweep_step("--device cuda --minutes 3.5 --deadline-s 225 --reserve-s 55", 400),)),
    # demo-train run 1 (2026-12-03): six runs of 2.1 min got ~700 steps each; the best copied names wrong in
    # JSON answers. Three runs of the two best recipes, up to 5.5 min each, done 420 s after the start.
    "demo-train-long": Suite(
        "the embedded demo model, longer: training.sweep with three runs (no synthetic copies, seeds 0 and 1; "
        "the same with lr 3e-3) of up to 5.5 min each, all done 420 s after the start; the best is "
        "gpt-oss-tiny-demo.safetensors (copy it to model/demo/)",
        carry=(".whl-site",),
        steps=(sweep_step("--device cuda --minutes 5.5 --deadline-s 420 --reserve-s 55 "
                          "--runs no-copies:0,no-copies:1,no-copies-lr3e-3:0", 480),)),
    "demo-train-smoke": Suite(
        "demo-train's machinery on a CPU: the same sweep with --smoke (small data, two runs of 20 steps)",
        carry=(), gpu=False, kind="cpu",
        steps=(sweep_step("--device cpu --smoke", 400, gpus=0),)),
    # issue 28: structured outputs' cost per token, one H200, 20b random weights, batch 64 (colocated: one decode
    # worker; the grammar work is the sampling rank's). The llguidance wheel travels in .whl (or inside
    # .whl-site/site.tar.xz once the lead rebuilds it): common/grammar.py names it.
    "grammar-gpu": Suite(
        "issue 28: structured outputs on the H200: the grammar GPU tests (bitmask in the batched CUDA sampler, "
        "constrained answers in the overlapped loop), then the served stack at batch 64 (20b random weights, "
        "1024 in / 256 out) without, with, and again without a json_schema response_format on every request",
        carry=(".whl-site", ".whl", ".cache/dgcarry", ".cache/fi"),
        steps=(step("grammar-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider "
                                         "tests/integration/test_grammar_gpu.py", 120, summary=PYTEST),
               step("serve-grammar", "{py} -m benchmarks.grammar_bench --batch 64 --input-len 1024 --output-len 256 "
                                     "--warmup 8 --out {out}/serve_grammar_gpt-oss-20b-h200.json --serve-args "
                                     + shlex.quote(SERVED_ARGS), 420, summary=r"grammar|Error|Traceback")),
        reproduces=("issue 28: the grammar's cost per output token at batch 64 (TPOT json / free)",)),
    # The sampler at temperature > 0 (served-sampled-1: ~1.0 ms per decode step at batch 64): the fused kernel's
    # GPU parity first, then its micro-benchmark against the torch race.
    "sampling-gpu": Suite(
        "the fused sampling kernel (kernels/sampling.py): its GPU tests (noise bits == the torch path's, tokens == "
        "the torch race at V = 201,088 and batch 1/64/256 but for near ties, the Sampler fused == unfused on a mixed "
        "batch, no host sync, CUDA-graph replay), then the micro-benchmark: torch race vs fused at batch 1/64/128/256 "
        "(graph and eager ms, R x V x 4 bytes read against this run's copy bandwidth) and a launch-shape sweep",
        carry=(".whl-site",),
        steps=(step("sampling-gpu-tests", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider "
                                          "tests/kernels/test_sampling_gpu.py", 110, summary=PYTEST),
               step("sampling-micro", "{py} -m benchmarks.sampling", 110, summary=r"^R=256|^sweep R=64|wrote|Error",
                    publish={"sampling.json": "kernels_sampling.json"})),
        reproduces=("served-sampled-1 (2026-12-03): the sampler's ~1.0 ms per decode step at batch 64, temperature 1",)),
    # The router's per-request CPU on issue 25's multi-turn workload: Harmony rendering, which tokenised every
    # earlier message of a conversation again each turn (router/harmony_render.py caches them per message).
    "router-render": Suite(
        "the router's Harmony rendering on the multi-turn workload (64 conversations x 8 turns, 2k-word shared system "
        "prompt, 100-300-word user turns, 100-200-word answers with reasoning), per request with the per-message "
        "token cache against without it, every prompt checked equal (CPU)",
        carry=(), gpu=False, kind="cpu",
        steps=(step("harmony-render", "{py} -m benchmarks.harmony_render --out {out}/harmony_render.json", 120,
                    summary=r"^turns 2\+|Error|Traceback", gpus=0,
                    publish={"harmony_render.json": "router_harmony_render.json"}),)),
    "cpu-smoke": Suite(
        "every suite's machinery on a CPU: the benchmarks' own smoke modes on tiny shapes (no GPU set-up)",
        carry=(), gpu=False, kind="cpu",
        steps=(step("model-tiny", "{py} -m benchmarks.bench_model --device cpu --preset tiny --attention torch "
                                  "--prefill-lens 64 --contexts 64 --batches 1,2 --tag tiny", 240, summary=r"^decode ctx|^prefill", gpus=0),
               step("kv-transfer-cpu", "{py} -m benchmarks.kv_transfer --devices cpu cpu --tokens 64 --layers 2 "
                                       "--iters 1 --placements contig --data-paths ipc --prefill-gflop-per-token 0.001", 240,
                    summary=r"wrote|ERROR", gpus=0),
               step("sampling-smoke", "{py} -m benchmarks.sampling --smoke", 60, summary=r"wrote|Error", gpus=0))),
}
