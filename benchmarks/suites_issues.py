"""GPU suites of issues 25-27 (prefix caching, FP8 KV, kernels to the floor): merged into
benchmarks/suites.py's SUITES, whose docstring says how suites run and are added."""

from __future__ import annotations

import shlex

from benchmarks.suite_defs import FUSION_AB, MT_SERVE_ARGS, PYTEST, SERVED_ARGS, Step, Suite, multi_turn_step, step

PREFILL_PREFIX = ("{py} -m benchmarks.prefill_prefix --device cuda --fp8 --random-weights gpt-oss-20b "
                  "--kv-cache-gib 12 --max-model-len 16384 ")
# the decode worker's engine in the multi-turn suite's decode settings (benchmarks/mixed_step.py)
MIXED_STEP = ("{py} -m benchmarks.mixed_step --device cuda --fp8 --random-weights gpt-oss-20b --kv-cache-gib 28 "
              "--max-num-seqs 128 --cuda-graphs --piecewise-graphs --max-model-len 16384 "
              "--max-num-batched-tokens 4096 ")

# the piecewise GPU tests' eager comparison on 2 random layers: rounding halves with depth, a wiring fault does not
PW_2LAYERS = step("piecewise-2layers", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                       "tests/integration/test_piecewise_gpu.py -k matches_eager", 90, summary=PYTEST,
                  env={"TANDEM_PW_LAYERS": "2"})


def colocated_pw_step(name: str, timeout_s: int, flags: str = "", bench: str = "") -> Step:
    """multi_turn_step's colocated run with ONE decode worker, piecewise graphs (+ `flags` to the decode worker,
    `bench` to the load) and its step trace."""
    return multi_turn_step("colocated", timeout_s, name=name, extra="--colocated-decode 1 --ready-timeout-s 300 " + bench,
                           serve_args=MT_SERVE_ARGS.replace("--cuda-graphs", f"--cuda-graphs --piecewise-graphs {flags}"
                                                            "--step-trace {out}/decode-steps-%p.jsonl"))

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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("ab-20b", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b", 540,
                    summary=r"^decode ctx|^prefill|summary|FAILED"),)),
    # The 12k goal between measured batches (fp8-kv-model-2: 11,159 tok/s at 87 per user at 128, 13,700 at
    # 53.5 at 256): the batches between, 8k only, with the bf16 A/B at 128.
    "fp8-kv-goal": Suite(
        "issue 26's decode goal alone: FP8 KV decode of 20b at 8k x 128/160/192/224 (>= 12,000 tok/s per GPU at "
        ">= 60 tok/s per user), bf16 pages at 8k x 128 and the 8k prefill A/B in the same process",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
    "multi-turn": Suite(
        "issue 25, prefix caching: multi-turn conversations (64 x 8 turns, 2k shared system prompt) on the served "
        "stack on one H200, colocated (two decode workers: cache-aware routing) and disaggregated, each with and "
        "without prefix caching: TTFT of turns 2+, prefill tokens computed, KV bytes shipped per turn, hit rate, "
        "leaked pages",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(multi_turn_step("colocated", 240), multi_turn_step("disaggregated", 310)),
        reproduces=("issue 25 goals: TTFT p50 of turns 2+ >= 3x lower than without caching; KV bytes per turn <= "
                    "the new tokens' KV; zero leaked pages",)),
    "prefill-prefix": Suite(
        "the prefill worker's engine alone on the H200 (gpt-oss-20b, the multi-turn suite's prefill settings): 352 "
        "tokens after a cached 3,296-token prefix against 352 and 3,648 uncached, compute time split into host "
        "before launch / launch / hooks / wait and the GPU span, with the sender's run-ahead bound 2 and none; one "
        "cached prefill profiled (kernels, their device time; cProfile of the host launch)",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("prefill-prefix", PREFILL_PREFIX + "--reps 10 --layers-ahead 2,-1 --profile --host-profile "
                                                       "--out {out}/prefill_prefix.json", 300,
                    summary=r"^P=|^cached|^uncached|profile|Error"),),
        reproduces=("multi-turn disaggregated (2026-12-03): prefill_compute p50 52.8 ms for ~355 computed tokens "
                    "with the cache, 71 ms for 3,645 without, on a GPU shared with the decode worker",)),
    # The prefill worker is host-launch-bound (prefill-prefix-1/-2: ~36 ms of wall time for ~11.7 ms of kernels
    # at N = 352): piecewise CUDA graphs (engine/piecewise.py) replay everything between attention calls.
    "piecewise-ab": Suite(
        "piecewise CUDA graphs for eager steps (--piecewise-graphs): their GPU test (20b widths, 4 layers: pieces "
        "vs eager forward at T = 1, 17, 352, 1000, a chunk after a prefix, a mixed step; hooks, fallback, pages), "
        "then the prefill worker's engine (gpt-oss-20b, the prefill-prefix suite's settings, run-ahead bound 2) "
        "without and with the flag",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("piecewise-gpu-test", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                          "tests/integration/test_piecewise_gpu.py", 100, summary=PYTEST),
               *(step(f"prefill-prefix-{tag}", PREFILL_PREFIX + f"--reps 5 --layers-ahead 2 {flag} "
                                                                "--out {out}/prefill_prefix.json",
                      150, summary=r"^P=|^cached|^uncached|Error")
                 for tag, flag in (("eager", ""), ("piecewise", "--piecewise-graphs")))),
        reproduces=("prefill-prefix-2 (2026-12-03): cached P+N (N = 352) 36 ms of compute for 11.7 ms of kernels",)),
    # Every served figure so far is greedy (loadgen sent temperature 0); OpenAI clients default to 1. At
    # temperature > 0 the sampler hashes exponential noise over the whole [B, 201088] logits, outside the graph.
    "served-sampled": Suite(
        "the served stack on one H200 (20b random weights, disaggregated: one prefill and one decode worker with "
        "CUDA graphs sharing the GPU), 64 streams of 1024 in / 512 out at once, greedy then temperature 1: what "
        "sampling costs per decode step",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=tuple(step(f"serve-t{t}", "{py} -m launcher.cli bench serve --launch disaggregated "
                                        "--num-requests 64 --max-concurrency 64 --input-len 1024 --output-len 512 "
                                        f"--warmup 8 --temperature {t} --save-requests --request-timeout-s 300 "
                                        f"--ready-timeout-s 300 --out {{out}}/serve_t{t}.json --serve-args "
                                        + shlex.quote(SERVED_ARGS), 270, summary=r"throughput|tpot|failed|Error")
                    for t in (0, 1)),
        reproduces=("the sampler's cost at temperature 1 against greedy, batch 64",)),
    # multi-turn's colocated step runs two decode processes time-slicing the GPU (cache-aware placement
    # between them); this one is how vLLM or SGLang would serve on one GPU: one decode worker alone.
    "multi-turn-colocated-1": Suite(
        "issue 25: multi-turn's colocated conversations (64 x 8 turns, 2k shared system prompt) with ONE decode "
        "worker alone on the H200, with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(multi_turn_step("colocated", 240, name="colocated-1", extra="--colocated-decode 1 "),),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",)),
    # Issue 25's colocated goal with the two start-up changes of 2026-12-03: piecewise CUDA graphs for the
    # mixed steps a local prefill runs in (buckets up to 2,048 tokens), and the workers' warm-up (compiles at
    # start-up, not in the first turns: multi-turn-colocated-1-1's two 2.3-2.5 s stalls). Both launches (cache
    # on / off) run the same flags; the service logs come back beside the JSON (slow steps are logged), and
    # the decode worker's step trace (engine/step_trace.py), one file per launch.
    "multi-turn-colocated-pw": Suite(
        "issue 25: multi-turn-colocated-1 (64 x 8 turns, 2k shared system prompt, ONE decode worker alone) with "
        "--piecewise-graphs on the decode worker, with and without prefix caching; then the same with "
        "--first-token-wait-ms 3 (the A/B of the bounded wait for steps that sampled first tokens, engine/core.py, "
        "off by default since run 10; this order reverses run 10's); first the overlapped loop's GPU tests (both "
        "orders and the bounded wait against the synchronous loop)",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("loop-gpu-tests", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider "
                                      "tests/integration/test_async_decode_gpu.py", 120,
                    summary=PYTEST + r"|collected first|first-token steps"),
               colocated_pw_step("colocated-1-pw", 200),
               colocated_pw_step("colocated-1-pw-wait", 200, "--first-token-wait-ms 3 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",)),
    # Issue 25's colocated goal: a served mixed step was host-bound (multi-turn-colocated-pw-11's step trace: launch
    # 18.2 ms of CPU against 12.5 ms of GPU, p50; 8.0 s of the loop's 22.8 s went to launching mixed steps), about
    # half of it the 24 attention islands (cProfile in mixed-step-6). Candidates, each opt-in until this suite
    # measures it: attention inside the piecewise graphs (--piecewise-graphed-attention sliding: 12 islands instead
    # of 24; all: none, the step is one graph, on the Triton kernel, which read decode rows at 90 % of copy bandwidth
    # where fa2 reached 94.6 %) and buckets 1.5x apart (--piecewise-buckets fine: less padding, which the MoE
    # computes like real rows). First the GPU tests of the pieces (all three ways, against the eager forward), then
    # the mixed step alone with each graph set in one process, then the served multi-turn run with the candidate
    # and with the defaults.
    "multi-turn-colocated-ab": Suite(
        "issue 25: the mixed step's host launch, A/B: piecewise GPU tests (islands, sliding attention in the "
        "graphs, all attention in the graphs), the mixed step alone (60 decoding at 3.5k + a 3,296-cached, 280-new "
        "turn) with pow2 buckets, fine buckets, sliding-in-graphs and all-in-graphs in one process, then "
        "multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker) with --piecewise-graphed-attention "
        "all --piecewise-buckets fine, "
        "then with the defaults",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("piecewise-gpu-tests", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                           "tests/integration/test_piecewise_gpu.py", 130, summary=PYTEST),
               step("mixed-step", MIXED_STEP + "--turns 5 --forwards piecewise-pow2,piecewise-fine,piecewise-sliding,"
                                               "piecewise-all --orders ready --mixed-roles decode "
                                               "--out {out}/mixed_step.json", 130,
                    summary=r"^decode steps|^mixed|Error|Traceback"),
               colocated_pw_step("colocated-1-graphed-fine", 150,
                                 "--piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 "),
               colocated_pw_step("colocated-1-pw", 150)),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "multi-turn-colocated-pw-10/11 (2026-12-03): 2.82x and 2.83x with the defaults")),
    # multi-turn-colocated-ab-1 (H100): a cached turn's TTFT p50 was 40.8 ms with either graph set, ~3 decode
    # periods (steps of ~63 sequences took ~11-13 ms): the overlapped loop queues step N+1 before an arrival
    # can join it. --launch-hold (engine/launch_hold.py) holds that launch until a decode launch's time before N
    # ends; a prompt joins if its mixed launch still fits, so it gains more where mixed launches are short
    # (attention in the graphs: 3.3 ms p50 against the islands' 10). TPOT p50 in the table: the price, if any.
    "launch-hold-ab": Suite(
        "issue 25: the piecewise GPU tests' eager comparison on 2 random layers (attention in the graphs differed "
        "by 0.086 on 4: rounding amplified, or a fault?), then multi-turn-colocated-pw's served run (64 x 8 turns, "
        "ONE decode worker, step trace) with the defaults, with --launch-hold and with --launch-hold "
        "--launch-hold-bubble 0.25; each with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(PW_2LAYERS,
               colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-hold", 150, "--launch-hold "),
               colocated_pw_step("colocated-1-hold-bubble", 150, "--launch-hold --launch-hold-bubble 0.25 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "multi-turn-colocated-ab-1 (2026-12-06, H100): 2.62x with the defaults")),
    # launch-hold-ab-1/2: no prompt was admitted from a hold; they reach the worker ~4-5 ms into a ~11 ms step, so
    # admission needs a mixed launch of a few ms: attention in the graphs (3.7 ms on a fast host). The same
    # served run with the defaults, the hold with attention in the graphs, and the hold with a bubble of half a
    # step (admits the islands' ~10 ms launches at the cost of an idle GPU).
    "launch-hold-graphed-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults, with --launch-hold --piecewise-graphed-attention all --piecewise-buckets fine, and with "
        "--launch-hold --launch-hold-bubble 0.5; each with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-hold-graphed-fine", 150,
                                 "--launch-hold --piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 "),
               colocated_pw_step("colocated-1-hold-bubble50", 150, "--launch-hold --launch-hold-bubble 0.5 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "launch-hold-ab-2 (2026-12-06, H100, ran as launch-hold-ab --only these three): no prompt "
                    "admitted from a hold")),
    # colocated-buckets-ab-1: with attention in the graphs a mixed launch takes ~4.4 ms, yet the hold launched 4 of 398
    # mixed steps from a hold: prompts come ~4-5 ms into a ~10 ms step, so launch + margin rarely fit before the
    # step in flight ends. A bubble of 0.3 of a step admits them at the cost of an idle GPU then (TPOT's price shows).
    "launch-hold-bubble-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults, the same load from 4 client processes (--client-procs 4: the client's own loop is in every TTFT), "
        "and with --launch-hold --launch-hold-bubble 0.3 --piecewise-graphed-attention all; each with and without "
        "prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-pw-clients4", 150, bench="--client-procs 4 "),
               colocated_pw_step("colocated-1-hold-graphed-bubble30", 150,
                                 "--launch-hold --launch-hold-bubble 0.3 --piecewise-graphed-attention all "
                                 "--piecewise-graphed-max-tokens 0 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "colocated-buckets-ab-1 (2026-12-06, H100): 2.88x with fine buckets (now the default)")),
    # kernel-defaults-check-1 (H100): a cached turn's mixed step (~300 tokens + ~63 decode rows) spans 16.6 ms on
    # the GPU against a decode step's 10.3; in the 512 bucket its ~190 padded rows route through the MoE like real
    # ones (engine/piecewise.py FINE_BUCKETS). Fine buckets alone, then with the hold and attention in the graphs
    # (the launch-hold-graphed-ab arm never run on a fast lease with the median admission rule).
    "colocated-buckets-ab": Suite(
        "issue 25: the piecewise GPU tests' eager comparison on 2 random layers (attention in the graphs at T=352), "
        "then multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults (pow2 buckets), with --piecewise-buckets fine, and with --launch-hold "
        "--piecewise-graphed-attention all --piecewise-buckets fine; each with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(PW_2LAYERS,
               colocated_pw_step("colocated-1-pw", 150, "--piecewise-buckets pow2 "),  # the default until this A/B
               colocated_pw_step("colocated-1-fine", 150, "--piecewise-buckets fine "),
               colocated_pw_step("colocated-1-hold-graphed-fine", 150,
                                 "--launch-hold --piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "kernel-defaults-check-1 (2026-12-06, H100): 2.56x with the defaults")),
    # colocated-buckets-ab-1: with fine buckets a cached turn's mixed step (~245 new tokens beside ~63 decode rows at
    # ~3.6k context) still spans 15.1 ms on the GPU against a decode step's 9.9; where do the 5 ms go?
    "mixed-step-profile": Suite(
        "issue 25: the decode worker's engine (20b, the multi-turn suite's decode settings, CUDA graphs + piecewise "
        "graphs with the default buckets) with 60 sequences decoding at 3.5k context while a new turn (3,296 cached + "
        "280 new tokens) joins: torch.profiler of the mixed step, then of a decode step of the same batch",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("mixed-step", MIXED_STEP + "--turns 3 --forwards piecewise --orders ready --mixed-roles decode "
                                               "--profile --out {out}/mixed_step.json", 200,
                    summary=r"^decode steps|^mixed|Error|Traceback"),)),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
    # launch-hold-bubble-ab-1 / colocated-buckets-ab-1 (H100): a cached turn's first token waits for the step in
    # flight, the step queued behind it and its own mixed step (~300 tokens beside ~63 decode rows: 15.1 ms on the
    # GPU against a decode step's 9.9). With --prefill-steps separate its own step is prompt-only (~250 tokens) and
    # the decode rows run in the step after it (SGLang's order).
    "prefill-steps-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with mixed "
        "steps (the default) and with --prefill-steps separate (one client process each), then separate with 4 "
        "client processes; each with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-separate", 150, "--prefill-steps separate "),
               colocated_pw_step("colocated-1-separate-clients4", 150, "--prefill-steps separate ",
                                 bench="--client-procs 4 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "colocated-buckets-ab-1 (2026-12-06, H100): 2.88x with the defaults")),
    # prefill-steps-ab-1 and launch-hold-bubble-ab-1 (H100 leases whose host was the limit): a cached turn's mixed
    # step launched in 16-18 ms of host time for ~14-18 ms of GPU work, decode steps in 3-5.7 ms (metadata 2.5-4.2).
    # Where that host time goes, per function (cProfile over 8 mixed launches and 32 decode steps).
    "mixed-host-profile": Suite(
        "issue 25: the decode worker's engine (20b, the multi-turn suite's decode settings, CUDA graphs + piecewise "
        "graphs) with 60 sequences decoding at 3.5k context while new turns (3,296 cached + 280 new tokens) join: "
        "cProfile of 8 mixed steps' iterations and 32 decode steps', us per step by function",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("mixed-step", MIXED_STEP + "--turns 3 --forwards piecewise --orders ready --mixed-roles decode "
                                               "--host-profile 8 --out {out}/mixed_step.json", 240,
                    summary=r"^decode steps|^mixed|Error|Traceback"),)),
    # launch-hold-bubble-ab-1 (a host-bound H100 lease): attention inside the graphs launched a cached turn's mixed step
    # in 7.6 ms against 18.2 (cached TTFT p50 46.1 vs 53.9 ms) but a 4,096-token step in 51.9 against 31.9 (the
    # cache-off side 35 ms worse). --piecewise-graphed-max-tokens keeps the graphs' attention to the small buckets.
    "graphed-small-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults, with attention inside the graphs for steps of <= 768 tokens only, and that with --launch-hold "
        "--launch-hold-bubble 0.3; each with and without prefix caching",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-graphed768", 150,
                                 "--piecewise-graphed-attention all --piecewise-graphed-max-tokens 768 "),
               colocated_pw_step("colocated-1-graphed768-hold", 150,
                                 "--piecewise-graphed-attention all --piecewise-graphed-max-tokens 768 --launch-hold "
                                 "--launch-hold-bubble 0.3 ")),
        reproduces=("issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching",
                    "colocated-buckets-ab-1 (2026-12-06, H100): 2.88x with the defaults")),
    # prefill-profile-1 (H100): of an 8k prefill's ~84 ms, the 12 full layers' attention took 16.4 ms on fa3's paged
    # mainloop although a prompt with no cached prefix has every key in its own k/v, and the 12 sliding layers
    # 3.5 ms (287 us each for 1/32 of a full layer's work); the MoE's SwiGLU pass 5.9 ms at ~1.9 TB/s.
    "prefill-reads-ab": Suite(
        "issue 27's prefill: FlashInfer's attention GPU tests (a fresh prompt read ragged against the reference and "
        "the paged read, self-tests, real dims), the MoE SwiGLU pass per row vs per tile (SWIGLU_TILE_EXPERT) at 8k, "
        "then gpt-oss-20b prefill 2k and 8k (FP8 QKV/O on DeepGEMM) A/B in one process: full layers read paged vs "
        "ragged, sliding reads on fa3 vs fa2; then the 8k profile with ragged full layers and fa2 sliding reads",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
    # multi-turn-colocated-pw-2's step trace: a cached turn's mixed step (~340 tokens, ~60 decodes) took 30 ms of
    # host time to launch. This reproduces that step alone; run 4 showed the step after it waiting ~27 ms on the
    # GPU, which the GPU spans and the timeline (busy time, idle gaps) now measure directly.
    "mixed-step": Suite(
        "issue 25: the decode worker's engine (20b, the multi-turn suite's decode settings, CUDA graphs + piecewise "
        "graphs) with 60 sequences decoding at 3.5k context while a new turn (3,296 cached + 280 new tokens) joins: "
        "host launch (and its CPU time), GPU span and wait of decode and mixed steps (piecewise graphs), the loop "
        "collecting a finished step first vs launching first, the mixed step's attention on fa2 (decode role, GQA "
        "packed) vs fa3, the turn's first-token time; cProfile and torch.profiler of one mixed step, and the GPU "
        "timeline of a mixed step with the step that collects it; first the overlapped loop's GPU tests (both loop "
        "orders) and FlashInfer's attention GPU tests (the self-test's mixed step now on fa2)",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("loop-flashinfer-gpu-tests", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider "
                                                 "tests/integration/test_async_decode_gpu.py tests/kernels/test_attention_gpu.py "
                                                 "-k 'async_decode or flashinfer'", 150,
                    summary=PYTEST + r"|collected first"),
               step("mixed-step", MIXED_STEP + "--turns 3 --forwards piecewise --orders ready,launch "
                                               "--mixed-roles decode,prefill --host-profile --profile --timeline "
                                               "--out {out}/mixed_step.json", 200,
                    summary=r"^decode steps|^mixed|^timeline|^  gap|Error|Traceback"),),
        reproduces=("multi-turn-colocated-pw-2 (2026-12-03): mixed steps' host launch 29.7 ms p50 (decode steps 4.7)",
                    "mixed-step-4 (2026-12-03): mixed step launch 12.5 ms, the next step's wait ~27 ms")),
    # Pure-decode steps over bf16 pages on the Triton decode kernel (--attention-backend flashinfer-triton-decode):
    # the kernel read bf16 pages 7 % faster than the generic one at 128 x 8k (fp8-kv-2) and, on e4m3 pages at batch 1,
    # 8.8 us per full layer against FlashInfer's 14 (decode-b1-1, decode-profile-1).
    "tdecode-ab": Suite(
        "bf16 pages' pure-decode steps on the Triton decode kernel against FlashInfer's: the backend's GPU test "
        "(reference, graph replay, self-test at real dims), then 20b decode replay at 8k x 1/64/128 with each",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("tdecode-gpu-test", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py "
                                        "-k triton_decode_backend", 90, summary=PYTEST),
               *(step(f"replay-{name}", "{py} -m benchmarks.kv_fp8_ab --preset gpt-oss-20b --prefill-lens '' "
                                        f"--attention {att} --contexts 8192 --batches 1 --bf16-contexts 8192 "
                                        "--bf16-batches 1,64,128", 90, summary=r"^decode ctx|FAILED")
                 for name, att in (("flashinfer", "flashinfer"), ("tdecode", "flashinfer-triton-decode")))),
        reproduces=("decode-profile-1 (2026-12-03): bf16 pages at 8k x 1 replay in 2.42 ms; attention 14 us per layer",)),
    "prefix-gpu-tests": Suite(
        "issue 25: prefix caching on the GPU (FlashInfer, CUDA graphs, overlapped loop): later turns hit, "
        "tokens agree with the uncached engine, no leaks; and the overlapped loop's GPU tests with the cache on",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
        steps=(step("prefix-gpu", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider tests/integration/test_prefix_cache_gpu.py "
                                  "tests/integration/test_async_decode_gpu.py", 300, summary=PYTEST),)),
    "fusion-ab": Suite(
        "issue 27's launch-bound fusions (--fusions): their GPU parity tests first (bits of the unfused kernels, "
        "self-tests, 20b layers, graph-decoded tokens), then each fused kernel against the launches it replaces "
        "(CUDA-graph us, GB/s vs HBM; norm warps and the DeepGEMM SwiGLU pass too), then gpt-oss-20b with the "
        "workers' defaults A/B in one process (" + FUSION_AB + "): prefill 8k, decode replay at 8k x 1 and 64",
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
        carry=(".whl-site", ".cache/dgcarry", ".cache/fi"),
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
