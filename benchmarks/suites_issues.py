"""GPU suites of issues 26-27 (FP8 KV, kernels to the floor) and the kernel side of issue 25: merged into
benchmarks/suites.py's SUITES, whose docstring says how suites run and are added. Issue 25's served suites are in
benchmarks/suites_served.py."""

from __future__ import annotations

from benchmarks.suite_defs import FUSION_AB, PYTEST, STACK_CARRY, Suite, smoke_step, step
from benchmarks.suites_served import colocated_pw_step


ISSUE_SUITES: dict[str, Suite] = {
    # issue 26: FP8 (e4m3) KV pages. Not published: the report's series and kernel targets are bf16-KV ones.
    "fp8-kv": Suite(
        "FP8 KV kernels: the GPU tests (reference bytes from the hardware conversions, Triton (decode kernel and "
        "generic) and FlashInfer (own e4m3 decode, and the default: e4m3 decode on the Triton decode kernel) with "
        "e4m3 pages at real dims, the decode kernel's launch configs and exact e4m3 codes, CUDA-graph replay, engine "
        "tokens) and the attention benchmark with e4m3 pages (paged decode 128 x 8k against copy bandwidth on the "
        "halved bytes: target 80 %; rows triton / triton-decode / fi-fa3 / fi-fa2, and the decode kernel's config "
        "sweep on 128 x 8k, its split targets on 64 x 8k and a few configs on bf16 pages: the summary names the best)",
        carry=(".whl-site", ".cache/fi"),
        steps=(step("fp8-kv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py",
                    260, summary=PYTEST),
               step("attention-fp8kv", "{py} -m benchmarks.attention --kv-fp8", 300, summary=r"^decode 128x8k frac"))),
    "fp8-kv-model": Suite(
        "FP8 KV against bf16 KV on one loaded 20b (workers' defaults): prefill 8k A/B (target <= 3 % slower), decode "
        "with e4m3 pages at 8k x 1/32/128/192/256 (target >= 12,000 tok/s per GPU at >= 60 tok/s per user) and "
        "32k x 128, bf16 pages at 8k and 32k x 128",
        carry=STACK_CARRY,
        steps=(step("ab-20b", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b", 540,
                    summary=r"^decode ctx|^prefill|summary|FAILED"),)),
    # The 12k goal between measured batches (fp8-kv-model-2: 11,159 tok/s at 87 per user at 128, 13,700 at
    # 53.5 at 256): the batches between, 8k only, with the bf16 A/B at 128.
    "fp8-kv-goal": Suite(
        "issue 26's decode goal alone: FP8 KV decode of 20b at 8k x 128/160/192/224 (>= 12,000 tok/s per GPU at "
        ">= 60 tok/s per user), bf16 pages at 8k x 128 and the 8k prefill A/B in the same process",
        carry=STACK_CARRY,
        steps=(step("ab-20b-8k", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b --contexts 8192 "
                                 "--batches 128,160,192,224 --bf16-contexts 8192 --bf16-batches 128", 330,
                    summary=r"^decode ctx|^prefill|summary|FAILED"),)),
    "fp8-kv-transfer": Suite(
        "bytes and time of one 32k-token 120b-shaped request between two processes on one H200, bf16 then e4m3 "
        "pages (half the bytes), NIXL and the IPC data path, byte-exact on the decode side",
        carry=(".whl-site",),  # the slim site carries nixl-cu13 (UCX with its CUDA transports)
        steps=tuple(step(f"kv-transfer-{dt}", "{py} -m benchmarks.kv_transfer --devices cuda:0 cuda:0 --tokens 32768 "
                                             f"--iters 3 --placements contig --nixl-timeout 110 --kv-cache-dtype {dt}",
                         260, summary=r"bytes per request|wrote|ERROR") for dt in ("bf16", "fp8"))),
    # mixed-step-profile-1 (H100): a 340-token mixed step's MoE took 382 us per layer (weights at 2.1 TB/s) where a
    # 60-row decode step's took 270 (2.95 TB/s, the copy rate): 2.7 ms of the step's 4.5 ms extra. 16-row tiles
    # (decode-style streaming: deeper pipelines, split-K) for the mid buckets, against the table's picks.
    "moe-tune-mid16": Suite(
        "the Triton FP8 MoE's mid buckets (M = 48, 32, 64 routed rows per expert: 384-, 256-, 512-token steps of 20b) "
        "with 16-row tiles added to the wide TMA space (6 stages, split-K 2); each bucket's current pick timed first",
        carry=(".whl-site",),
        steps=(step("tune", "{py} -m benchmarks.tune_moe --no-bf16 --wide --tma --wide-from 8 --mid16 --buckets 48,32,64 "
                            "--base kernels/tuning/moe.json --budget 230", 300, summary=r"tuned table|Error"),)),
    # Issue 27's decode table, regenerated with today's defaults; e4m3 pages next to bf16 (fp8-kv-model-2: batch 1
    # at 8k replays in 3.05 ms with e4m3 pages, slower than bf16's 2.44 where batch 128 is 1.29x faster).
    "decode-profile": Suite(
        "where a 20b decode step's time goes at 8k context (eager step under torch.profiler, workers' defaults): "
        "batch 1 and 64 on bf16 pages, batch 1 on e4m3 pages; then decode replay (CUDA graphs) at 8k x 1 for both",
        carry=STACK_CARRY,
        steps=(step("profile-bf16", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches 1,64", 150,
                    summary=r"CUDA kernels per step|Error"),
               step("profile-fp8", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches 1 "
                                   "--kv-cache-dtype fp8", 120, summary=r"CUDA kernels per step|Error"),
               step("replay-b1", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b --prefill-lens '' --contexts 8192 "
                                 "--batches 1 --bf16-contexts 8192 --bf16-batches 1", 150,
                    summary=r"^decode ctx|FAILED")),
        reproduces=("issue 27's decode profile table (2026-12-02: batch 1, 8k, eager)",)),
    # Issue 27's prefill goal (8k <= 70 ms; fp8-gemv-ab-1: 84.3 ms with FP8 QKV/O, 89.3 bf16) had no table of
    # where the time goes: the MoE's DeepGEMM GEMMs against its gather / SwiGLU / combine passes, attention, norms.
    "prefill-profile": Suite(
        "where a 20b prefill of 8k tokens spends its time (eager, torch.profiler, 3 prefills, workers' defaults): "
        "FP8 QKV/O (the faster prefill) and bf16 QKV/O",
        carry=STACK_CARRY,
        steps=tuple(step(f"profile-prefill-{tag}", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b "
                                                   f"--batches '' --prefill-lens 8192 {flag}", 120,
                         summary=r"CUDA kernels per step|Error")
                    for tag, flag in (("fp8", "--fp8-attention"), ("bf16", ""))),
        reproduces=("fp8-gemv-ab-1 (2026-12-03): 20b prefill 8k 84.3 ms (FP8 QKV/O), 89.3 ms (bf16)",)),
    # decode-profile-1's two batch-1 costs of e4m3 pages: the quantising K/V store (~20 us per layer: 16-token
    # programs of divisions for 1 token) and the split merge (33 us per full layer: a serial loop over 64
    # splits per program). Both changed; this checks bits and times them.
    "decode-b1": Suite(
        "batch-1 decode over e4m3 pages after the store and merge changes: the FP8-KV GPU tests (bits of the "
        "quantising store, the decode kernel with splits against the reference), the fused RoPE + store micro "
        "(tokens per K program 1/2/4/16), decode replay at 8k x 1 on e4m3 and bf16 pages, the e4m3 profile",
        carry=STACK_CARRY,
        steps=(step("fp8-kv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py",
                    200, summary=PYTEST),
               step("fusion-micro", "{py} -m benchmarks.fusion --tokens 1,64,8192", 100, summary=r"wrote|Error"),
               step("replay-b1", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b --prefill-lens '' --contexts 8192 "
                                 "--batches 1,64 --bf16-contexts 8192 --bf16-batches 1", 120,
                    summary=r"^decode ctx|FAILED"),
               step("profile-fp8", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches 1 "
                                   "--kv-cache-dtype fp8", 100, summary=r"CUDA kernels per step|Error")),
        reproduces=("decode-profile-1 (2026-12-03): e4m3 pages at 8k x 1 replay in 2.99 ms against bf16's 2.42",)),
    # The MoE at the sizes served multi-turn steps run: decode steps of ~64 sequences (M = 8 routed rows per
    # expert) and mixed steps of ~300-400 tokens (M = 32-48), which sat between the tuned buckets (4, 16, 64) and
    # were tuned before the TMA weight tiles existed. The shipped table's pick is timed first in the same process.
    "moe-tune-mid": Suite(
        "MoE tiles for the buckets between decode and prefill (M = 48, 8, 64, 32, 16 routed rows per expert: 384-, "
        "64-, 512-, 256- and 128-token steps of 20b), FP8 experts, the wide space with TMA weight tiles; each "
        "bucket's current pick (kernels/tuning/moe.json, nearest bucket) timed first on the same inputs",
        carry=(".whl-site",),
        steps=(step("tune", "{py} -m benchmarks.tune_moe --no-bf16 --wide --tma --wide-from 8 --buckets 48,8,64,32,16 "
                            "--base kernels/tuning/moe.json --budget 400", 480, summary=r"tuned table|Error"),)),
    # prefill-profile-1 (H100): of an 8k prefill's ~84 ms, the 12 full layers' attention took 16.4 ms on fa3's paged
    # mainloop although a prompt with no cached prefix has every key in its own k/v, and the 12 sliding layers
    # 3.5 ms (287 us each for 1/32 of a full layer's work); the MoE's SwiGLU pass 5.9 ms at ~1.9 TB/s.
    "prefill-reads-ab": Suite(
        "issue 27's prefill: FlashInfer's attention GPU tests (a fresh prompt read ragged against the reference and "
        "the paged read, self-tests, real dims), the MoE SwiGLU pass per row vs per tile (SWIGLU_TILE_EXPERT) at 8k, "
        "then gpt-oss-20b prefill 2k and 8k (FP8 QKV/O on DeepGEMM) A/B in one process: full layers read paged vs "
        "ragged, sliding reads on fa3 vs fa2; then the 8k profile with ragged full layers and fa2 sliding reads",
        carry=STACK_CARRY,
        steps=(step("attention-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_gpu.py "
                                           "-k 'fresh_prefill or flashinfer_self_test or flashinfer_real_dims'", 150,
                    summary=PYTEST),
               step("swiglu-micro", "{py} -m benchmarks.fusion --tokens 8192 --rows swiglu", 60,
                    summary=r"^swiglu|wrote|Error"),
               step("model-20b-reads", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                       "--prefill-lens 2048,8192 --contexts '' --batches '' "
                                       "--prefill-reads paged,ragged,paged/fa2,ragged/fa2 "
                                       "--tag gpt-oss-20b-tp1-prefill-reads-ab", 200,
                    summary=r"^prefill|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-prefill-reads-ab.json": "model_gpt-oss-20b-tp1-prefill-reads-ab.json"}),
               step("profile-ragged", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches '' "
                                      "--prefill-lens 8192 --fp8-attention --linear deepgemm --prefill-reads ragged/fa2",
                    120, summary=r"CUDA kernels per step|Error")),
        reproduces=("prefill-profile-1 (2026-12-06, H100): 8k prefill ~84 ms, full layers' paged attention 16.4 ms",)),
    # The defaults changed 2026-12-06 after prefill-reads-ab-1 and moe-tune-mid-1: a fresh prompt's full layers read
    # ragged, prefill sliding reads on fa2, the DeepGEMM MoE's SwiGLU pass per tile, the Triton MoE's tiles for
    # buckets 8-64 (decode and mixed steps). Their GPU tests, the prefill before/after, and what they do served.
    "kernel-defaults-check": Suite(
        "the 2026-12-06 kernel defaults: GPU tests (FlashInfer fresh-prompt reads and self-tests, the SwiGLU tile "
        "pass's bits, the Triton FP8 MoE at 64-384 tokens on the new tiles), gpt-oss-20b prefill 8k with the old reads "
        "(paged/fa3) and the new (ragged/fa2) in one process plus decode replay at 8k x 1 and 64, "
        "multi-turn-colocated-pw's served run (issue 25: 64 x 8 turns, ONE decode worker), and the piecewise GPU "
        "tests (attention in the graphs judged against the eager forward on the same kernels)",
        carry=STACK_CARRY,
        steps=(step("kernel-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention_gpu.py "
                                        "tests/kernels/test_fusion_gpu.py tests/kernels/test_gemm_moe_gpu.py "
                                        "-k 'flashinfer or swiglu or fp8_moe_real_dims'", 120, summary=PYTEST),
               step("model-20b", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                 "--prefill-lens 8192 --contexts 8192 --batches 1,64 --prefill-reads paged/fa3,ragged/fa2 "
                                 "--tag gpt-oss-20b-tp1-kernel-defaults", 110, summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-kernel-defaults.json": "model_gpt-oss-20b-tp1-kernel-defaults.json"}),
               colocated_pw_step("colocated-1-pw", 150),
               step("piecewise-gpu-tests", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                           "tests/integration/test_piecewise_gpu.py", 130, summary=PYTEST)),
        reproduces=("prefill-reads-ab-1 (2026-12-06, H100): 8k prefill 87.3 ms (paged/fa3) -> 85.1 (ragged/fa2)",
                    "launch-hold-ab-1 (2026-12-06, H100): colocated cached TTFT 2.71x with the defaults")),
    # Pure-decode steps over bf16 pages on the Triton decode kernel (--attention-backend flashinfer-triton-decode):
    # the kernel read bf16 pages 7 % faster than the generic one at 128 x 8k (fp8-kv-2) and, on e4m3 pages at batch 1,
    # 8.8 us per full layer against FlashInfer's 14 (decode-b1-1, decode-profile-1).
    "tdecode-ab": Suite(
        "bf16 pages' pure-decode steps on the Triton decode kernel against FlashInfer's: the backend's GPU test "
        "(reference, graph replay, self-test at real dims), then 20b decode replay at 8k x 1/64/128 with each",
        carry=STACK_CARRY,
        steps=(step("tdecode-gpu-test", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py "
                                        "-k triton_decode_backend", 90, summary=PYTEST),
               *(step(f"replay-{name}", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b --prefill-lens '' "
                                        f"--attention {att} --contexts 8192 --batches 1 --bf16-contexts 8192 "
                                        "--bf16-batches 1,64,128", 90, summary=r"^decode ctx|FAILED")
                 for name, att in (("flashinfer", "flashinfer"), ("tdecode", "flashinfer-triton-decode")))),
        reproduces=("decode-profile-1 (2026-12-03): bf16 pages at 8k x 1 replay in 2.42 ms; attention 14 us per layer",)),
    # Issue 27's batch-1 decode: the pieces measured apart on the H200 (tdecode-ab-1: bf16 pages on the Triton decode
    # kernel 2.336 vs FlashInfer 2.415 ms at 8k x 1, 1 % slower at 64; decode-b1-1: e4m3 pages 2.16; fp8-gemv-ab-2:
    # the few-token FP8 QKV/O kernel's 128-row tiles, never timed in the model) in one lease, the batches between 1
    # and 64 for a crossover, and the disaggregated smoke on FlashInfer (disagg-smoke-fi, never run) first.
    "b1-ab": Suite(
        "disaggregated == colocated greedy tokens with FlashInfer attention (disagg-smoke-fi's step), then 20b decode "
        "replay at 8k: bf16 QKV/O on bf16 pages with FlashInfer's decode vs the Triton decode kernel at batch 1, 4, "
        "16, 32, and FP8 QKV/O (DeepGEMM linear) on e4m3 pages with and without the few-token FP8 kernel at batch 1",
        carry=STACK_CARRY,
        steps=(smoke_step("flashinfer", "--attention-backend flashinfer", timeout_s=170),
               *(step(f"replay-{name}", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                        f"--attention {att} --prefill-lens '' --contexts 8192 --batches 1,4,16,32 "
                                        f"--tag gpt-oss-20b-tp1-b1-{name}", 100, summary=r"^decode ctx|FAILED|Error",
                      publish={f"model_gpt-oss-20b-tp1-b1-{name}.json": f"model_gpt-oss-20b-tp1-b1-{name}.json"})
                 for name, att in (("flashinfer", "flashinfer"), ("tdecode", "flashinfer-triton-decode"))),
               step("replay-fp8", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                  "--kv-cache-dtype fp8 --prefill-lens '' --contexts 8192 --batches 1 "
                                  "--fusions rope_store,rope_store+fp8_gemv --tag gpt-oss-20b-tp1-b1-fp8", 120,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-b1-fp8.json": "model_gpt-oss-20b-tp1-b1-fp8.json"})),
        reproduces=("tdecode-ab-1 (2026-12-03, H200): 8k x 1 replay 2.415 (FlashInfer) / 2.336 ms (Triton decode)",)),
    # Issue 27 asks for FP8 QKV/O where it measures faster (and its accuracy delta if it becomes the default). Batch 1
    # is faster with it (b1-ab-1, prefetch-ab-1: 2.52-2.59 ms against the defaults' 2.69) and prefill 8k was (fp8-gemv-ab-1,
    # H200: 84.3 vs 89.3 ms); batches between were never timed with the few-token kernel at one token.
    "fp8-qkvo-ab": Suite(
        "FP8 QKV/O as the workers' default? gpt-oss-20b on bf16 pages, prefill 8k and decode replay at 8k x 1/4/16/64: "
        "the defaults (bf16 QKV/O on cuBLAS) against FP8 QKV/O (DeepGEMM linear, one-token steps on the few-token FP8 "
        "kernel: --fusions norm_router+rope_store+fp8_gemv), each its own process, same lease",
        carry=STACK_CARRY,
        steps=tuple(step(f"model-{name}", "{py} -m benchmarks.bench_model --preset gpt-oss-20b " + flags +
                         f"--prefill-lens 8192 --contexts 8192 --batches 1,4,16,64 --tag gpt-oss-20b-tp1-qkvo-{name}", 130,
                         summary=r"^prefill|^decode ctx|FAILED|Error",
                         publish={f"model_gpt-oss-20b-tp1-qkvo-{name}.json": f"model_gpt-oss-20b-tp1-qkvo-{name}.json"})
                    for name, flags in (("bf16", "--bf16-attention "),
                                        ("fp8", "--linear deepgemm --fusions norm_router+rope_store+fp8_gemv "))),
        reproduces=("fp8kv-mixed-ab-1 (2026-12-06, H100): defaults prefill 8k 86.97 ms, 8k x 1 2.692, x 64 13.388",)),
    # prefetch-ab-1: a one-token projection is bound by its chain of dependent steps (split-K partials, arrival, the
    # last CTA's sum), not by streaming W. kernels/gemv.py's one-token path has none: whole rows per program, FMAs.
    "gemv-rows-ab": Suite(
        "issue 27's bf16 attention projections at one token on whole W rows per program (kernels/gemv.py rows_t1: one "
        "launch, no split, CUDA-core FMAs): the gemv GPU tests (parity with fp32 and addmm, bits, graph replay; the "
        "MMA path at one token too), the kernel against addmm by config (W streamed from HBM), then gpt-oss-20b with "
        "the workers' defaults (bf16 QKV/O, bf16 pages) at 8k x 1, norm_router+rope_store vs +gemv in one process",
        carry=STACK_CARRY,
        steps=(step("gemv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemv_gpu.py",
                    120, summary=PYTEST),
               step("gemv-micro", "{py} -m benchmarks.fusion --tokens 1 --rows gemv", 90, summary=r"^gemv|wrote|Error"),
               step("replay-b1", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens '' "
                                 "--contexts 8192 --batches 1 --fusions norm_router+rope_store,norm_router+rope_store+gemv "
                                 "--tag gpt-oss-20b-tp1-gemv-rows", 120, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-gemv-rows.json": "model_gpt-oss-20b-tp1-gemv-rows.json"})),
        reproduces=("fp8-qkvo-ab-1 (2026-12-06, H100): defaults 8k x 1 replay 2.746 ms; gemv-ab-1 (H200): the MMA gemv "
                    "13.15 us for QKV at one token against addmm's 10.28",)),
    # Issue 27's "must show" in one call, for the first H200 that comes (120b needs its memory: pass needs_h200).
    "issue27-h200": Suite(
        "issue 27's figures on one H200: gpt-oss-20b prefill 8k and decode replay at 8k x 1 (and 64) with the workers' "
        "defaults and with the best batch-1 configuration measured on H100s (FP8 QKV/O + the few-token FP8 kernel on "
        "e4m3 pages, b1-ab-1), gpt-oss-120b's prefill 8k and 8k x 1 with the defaults, and the 20b decode profile table "
        "(batch 1 and 64) regenerated; and the one-token gemv default (gemv-rows-ab-1, H100) against the old default at 8k "
        "x 1. Needs an H200 (120b does not fit an H100): run with needs_h200",
        carry=STACK_CARRY,
        steps=(step("model-20b", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 "
                                 "--contexts 8192 --batches 1,64 --tag gpt-oss-20b-tp1-issue27", 80,
                    summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-issue27.json": "model_gpt-oss-20b-tp1-issue27.json"}),
               step("model-20b-b1best", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                        "--kv-cache-dtype fp8 --prefill-lens 8192 --contexts 8192 --batches 1 "
                                        "--fusions norm_router+rope_store+fp8_gemv --tag gpt-oss-20b-tp1-issue27-b1best",
                    80, summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-issue27-b1best.json": "model_gpt-oss-20b-tp1-issue27-b1best.json"}),
               step("gemv-ab-b1", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens '' "
                                  "--contexts 8192 --batches 1 --fusions norm_router+rope_store,gemv+norm_router+rope_store "
                                  "--tag gpt-oss-20b-tp1-issue27-gemv", 40, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-issue27-gemv.json": "model_gpt-oss-20b-tp1-issue27-gemv.json"}),
               step("model-120b", "{py} -m benchmarks.bench_model --preset gpt-oss-120b --bf16-attention --prefill-lens 8192 "
                                  "--contexts 8192 --batches 1 --tag gpt-oss-120b-tp1-issue27", 200,
                    summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-120b-tp1-issue27.json": "model_gpt-oss-120b-tp1-issue27.json"}),
               step("profile-20b", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches 1,64", 150,
                    summary=r"CUDA kernels per step|Error")),
        reproduces=("issue 27 (2026-12-02, H200): 20b prefill 8k 89.8 ms, 8k x 1 replay 2.44 ms; 120b 162 ms, 3.53 ms",)),
    # issue27-h100-1's batch-1 profile: `_decode_fwd` 226 us + merge 30 us a step, ~15 us per full layer at 8k (2.6x
    # its K/V read at copy bandwidth), in the config tuned on 64-128 sequences (64 splits of 2 blocks at one sequence)
    "b1-probes": Suite(
        "issue 27's batch-1 step, two probes: the Triton decode kernel at ONE sequence over its splits, keys per block "
        "and stages (CUDA-graph replays of read + split merge, bf16 and e4m3 pages, 8k, 32k and a sliding layer, "
        "fastest first per case against the configs the workers use); and the few-token MoE's two kernels against "
        "bare streams of the same weight boxes (same grid and TMA boxes, the K loop alone) and of a tiled copy of "
        "the weights (every box contiguous), GB/s against the copy bandwidth of the same run",
        carry=STACK_CARRY,
        steps=(step("decode-b1", "{py} -m benchmarks.decode_b1", 170, summary=r"^b1 |rule|done|Error"),
               step("moe-small-probe", "{py} -m benchmarks.moe_small_probe", 120, summary=r"^probe|done|Error"))),
    "norm-quant-b1-ab": Suite(
        "issue 27's batch-1 MoE: x quantised by the fused norm before it (norm_quant), so the few-token gate_up's CTAs "
        "only route and stream (b1-probes-2: their own quantisation cost ~2 us of 35 a layer), with the norm's "
        "quantisation spread over the row's programs up to 64 tokens (one program a row cost 2 us at one token, "
        "fusion-ab-1): the GPU tests (the MoE takes the norm's FP8 copy with the same bits, both paths; the fused "
        "norm's outputs and the model's fusions at real widths), the norm rows of the fusion micro-benchmark (spread "
        "vs one program, with and without the router), the decode kernel on a sliding layer at one sequence (64-key "
        "blocks in one split, what the workers read since c8bacd0, vs 32-key blocks in two splits + merge), then "
        "gpt-oss-20b A/B in one process at 8k x 1 and x 64",
        carry=STACK_CARRY,
        steps=(step("norm-quant-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fusion_gpu.py "
                                            "-k 'fp8_copy or model_fusions or fused_norm'", 120, summary=PYTEST),
               step("norm-micro", "{py} -m benchmarks.fusion --tokens 1,2,64,8192 --rows norm", 90,
                    summary=r"^norm\+(router\+)?quant|wrote|Error"),
               step("decode-b1-sliding", "{py} -m benchmarks.decode_b1 --cases 8k-sliding", 60,
                    summary=r"^b1 |done|Error"),
               step("model-20b-ab", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens '' "
                                    "--contexts 8192 --batches 1,64 --fusions gemv+norm_router+rope_store,"
                                    "gemv+norm_router+rope_store+norm_quant --tag gpt-oss-20b-tp1-norm-quant-ab", 120,
                    summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-norm-quant-ab.json": "model_gpt-oss-20b-tp1-norm-quant-ab.json"}))),
    # norm-quant-b1-ab-1 (H200) measured norm_quant at 1 and 64 tokens (a default since, up to 64 tokens); here the
    # GPU tests after its quantisation moved to its own loads, and whether the gate may rise to prefill sizes.
    "norm-quant-default-check": Suite(
        "the norm_quant default (the MoE's FP8 input quantised in the norm launch, up to 64 tokens): every fused-norm "
        "GPU test (its y equal to the plain norm's now that it quantises from its own loads; the model's fusions at "
        "real widths), the norm rows of the fusion micro-benchmark at 1-8,192 tokens, gpt-oss-20b A/B in one process "
        "at 8k x 1 and x 64, the same at prefill 2k and 8k with the token gate lifted (is norm_quant worth it there), "
        "and gpt-oss-120b at 8k x 1 A/B",
        carry=STACK_CARRY,
        steps=(step("fusion-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fusion_gpu.py",
                    120, summary=PYTEST),
               step("norm-micro", "{py} -m benchmarks.fusion --tokens 1,64,300,2048,8192 --rows norm", 70,
                    summary=r"^norm\+(router\+)?quant|wrote|Error"),
               step("model-20b-ab", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens '' "
                                    "--contexts 8192 --batches 1,64 --fusions gemv+norm_router+rope_store,"
                                    "gemv+norm_quant+norm_router+rope_store --tag gpt-oss-20b-tp1-norm-quant-default",
                    90, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-norm-quant-default.json":
                             "model_gpt-oss-20b-tp1-norm-quant-default.json"}),
               step("prefill-20b-ungated", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                           "--prefill-lens 2048,8192 --batches '' --norm-quant-max-tokens 1000000 "
                                           "--fusions gemv+norm_router+rope_store,gemv+norm_quant+norm_router+rope_store "
                                           "--tag gpt-oss-20b-tp1-norm-quant-prefill", 90,
                    summary=r"^prefill|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-norm-quant-prefill.json":
                             "model_gpt-oss-20b-tp1-norm-quant-prefill.json"}),
               step("model-120b-ab", "{py} -m benchmarks.bench_model --preset gpt-oss-120b --bf16-attention "
                                     "--prefill-lens '' --contexts 8192 --batches 1 --fusions gemv+norm_router+rope_store,"
                                     "gemv+norm_quant+norm_router+rope_store --tag gpt-oss-120b-tp1-norm-quant-default",
                    150, summary=r"^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-120b-tp1-norm-quant-default.json":
                             "model_gpt-oss-120b-tp1-norm-quant-default.json"}))),
    "fusion-ab": Suite(
        "issue 27's launch-bound fusions (--fusions): their GPU parity tests first (bits of the unfused kernels, "
        "self-tests, 20b layers, graph-decoded tokens), then each fused kernel against the launches it replaces "
        "(CUDA-graph us, GB/s vs HBM; norm warps and the DeepGEMM SwiGLU pass too), then gpt-oss-20b with the "
        "workers' defaults A/B in one process (" + FUSION_AB + "): prefill 8k, decode replay at 8k x 1 and 64",
        carry=STACK_CARRY,
        steps=(step("fusion-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fusion_gpu.py",
                    170, summary=PYTEST),
               step("fusion-micro", "{py} -m benchmarks.fusion", 100, summary=r"wrote|Error"),
               step("model-20b-ab", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                    "--prefill-lens 8192 --contexts 8192 --batches 1,64 --fusions " + FUSION_AB +
                                    " --tag gpt-oss-20b-tp1-fusion-ab", 280,
                    summary=r"^decode ctx|^prefill|FAILED",
                    publish={"model_gpt-oss-20b-tp1-fusion-ab.json": "model_gpt-oss-20b-tp1-fusion-ab.json"})),
        reproduces=("issue 27: the fusions' share of the 20b prefill 8k (89.8 ms) and batch-1 decode replay "
                    "(2.44-2.53 ms at 8k)",)),
    # decode-profile-1: the bf16 QKV/O projections took 654 us of a 20b batch-1 step at 8k (cuBLASLt addmm,
    # split-K + reduce: 1.27 GB at 1.9 TB/s). kernels/gemv.py streams W once per call (Fusion.FEW_TOKEN_LINEAR).
    "gemv-ab": Suite(
        "issue 27's few-token linear (--fusions ...+gemv): its GPU tests (20b QKV / O at 1, 4, 16 tokens: fp32 "
        "reference and addmm parity, bits run to run, CUDA-graph replay, routing), then the kernel against torch addmm "
        "with W streamed from HBM (CUDA-graph us, GB/s vs HBM and copy; default config and a small sweep), then "
        "gpt-oss-20b with bf16 attention A/B in one process (rope_store vs rope_store+gemv): prefill 8k, decode "
        "replay at 8k x 1 and 64",
        carry=STACK_CARRY,
        steps=(step("gemv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gemv_gpu.py",
                    100, summary=PYTEST),
               step("gemv-micro", "{py} -m benchmarks.fusion --tokens 1,4,16 --rows gemv", 120,
                    summary=r"^gemv|wrote|Error"),
               step("model-20b-ab", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                    "--prefill-lens 8192 --contexts 8192 --batches 1,64 --fusions rope_store,"
                                    "rope_store+gemv --tag gpt-oss-20b-tp1-gemv-ab", 300,
                    summary=r"^decode ctx|^prefill|FAILED",
                    publish={"model_gpt-oss-20b-tp1-gemv-ab.json": "model_gpt-oss-20b-tp1-gemv-ab.json"})),
        reproduces=("decode-profile-1 (2026-12-03): bf16 QKV/O 654 us per 20b batch-1 decode step at 8k (1.9 TB/s); "
                    "issue 27 target: batch-1 decode <= 1.7 ms",)),
    # decode-profile-1: the bf16 QKV/O projections took 654 us of a 20b batch-1 step at 8k; the bf16 GEMV lost to
    # addmm (gemv-ab-1). In FP8 they are half the bytes; kernels/dense_small.py reads them with the few-token MoE's
    # machinery (Fusion.FEW_TOKEN_FP8), and the prefill side of FP8 QKV/O is DeepGEMM's (4-15 % faster, DG14).
    "fp8-gemv-ab": Suite(
        "issue 27's FP8 attention projections at decode: the few-token FP8 dense kernel's GPU tests (20b QKV / O at "
        "1, 4, 16 tokens: reference parity, bits run to run, CUDA-graph replay, routing) and the one-launch "
        "rope_qk's, then QKV / O against bf16 addmm with W streamed from HBM (CUDA-graph us; a config sweep), then gpt-oss-20b prefill 8k and decode replay at 8k x 1: bf16 QKV/O (the "
        "workers' default), and FP8 QKV/O on DeepGEMM A/B in one process (rope_store vs rope_store+fp8_gemv)",
        carry=STACK_CARRY,
        steps=(step("fp8-gemv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_dense_small_gpu.py "
                                          "tests/kernels/test_fusion_gpu.py -k 'dense or rope_qk_store_kv_exact'",
                    90, summary=PYTEST),
               step("fp8-gemv-micro", "{py} -m benchmarks.fusion --tokens 1,4,16 --rows fp8gemv", 100,
                    summary=r"^fp8gemv|wrote|Error"),
               step("model-20b-bf16", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention "
                                      "--prefill-lens 8192 --contexts 8192 --batches 1 --fusions rope_store "
                                      "--tag gpt-oss-20b-tp1-fp8-gemv-base", 150,
                    summary=r"^decode ctx|^prefill|FAILED"),
               step("model-20b-fp8", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --linear deepgemm "
                                     "--prefill-lens 8192 --contexts 8192 --batches 1,64 --fusions rope_store,"
                                     "rope_store+fp8_gemv --tag gpt-oss-20b-tp1-fp8-gemv-ab", 220,
                    summary=r"^decode ctx|^prefill|FAILED")),
        reproduces=("decode-profile-1 (2026-12-03): bf16 QKV/O 654 us per 20b batch-1 decode step at 8k (1.9 TB/s); "
                    "issue 27 targets: batch-1 decode <= 1.7 ms, prefill 8k <= 70 ms",)),
}
