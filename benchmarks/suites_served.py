"""GPU suites of issue 25's served path (prefix caching, multi-turn serving: colocated and disaggregated A/Bs, the
decode worker's mixed steps, the launch hold): merged into benchmarks/suites.py's SUITES, whose docstring says how
suites run and are added."""

from __future__ import annotations

import shlex

from benchmarks.suite_defs import (MT_SERVE_ARGS, PYTEST, SERVED_ARGS, STACK_CARRY, Step, Suite, multi_turn_step,
                                   remote_prefill_step, smoke_step, step)

PREFILL_PREFIX = ("{py} -m benchmarks.prefill_prefix --device cuda --fp8 --random-weights gpt-oss-20b "
                  "--kv-cache-gib 12 --max-model-len 16384 ")
# the decode worker's engine in the multi-turn suite's decode settings (benchmarks/mixed_step.py)
MIXED_STEP = ("{py} -m benchmarks.mixed_step --device cuda --fp8 --random-weights gpt-oss-20b --kv-cache-gib 28 "
              "--max-num-seqs 128 --cuda-graphs --piecewise-graphs --max-model-len 16384 "
              "--max-num-batched-tokens 4096 ")

MIXED_STEP_SUMMARY = r"^decode steps|^mixed|Error|Traceback"  # its table's lines, or why it has none
COLOCATED_GOAL = "issue 25 goal, colocated: TTFT p50 of turns 2+ >= 3x lower than without caching"

# the piecewise GPU tests' eager comparison on 2 random layers: rounding halves with depth, a wiring fault does not
PW_2LAYERS = step("piecewise-2layers", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                       "tests/integration/test_piecewise_gpu.py -k matches_eager", 90, summary=PYTEST,
                  env={"TANDEM_PW_LAYERS": "2"})


def colocated_pw_step(name: str, timeout_s: int, flags: str = "", bench: str = "", serve: str = "") -> Step:
    """multi_turn_step's colocated run with ONE decode worker, piecewise graphs (+ `flags` to the decode worker,
    `bench` to the load, `serve` to `tandem serve`: both roles) and its step trace."""
    return multi_turn_step("colocated", timeout_s, name=name, extra="--colocated-decode 1 --ready-timeout-s 300 " + bench,
                           serve_args=serve + MT_SERVE_ARGS.replace("--cuda-graphs", f"--cuda-graphs --piecewise-graphs {flags}"
                                                                    "--step-trace {out}/decode-steps-%p.jsonl"))


SERVED_SUITES: dict[str, Suite] = {
    "multi-turn": Suite(
        "issue 25, prefix caching: multi-turn conversations (64 x 8 turns, 2k shared system prompt) on the served "
        "stack on one H200, colocated (two decode workers: cache-aware routing) and disaggregated, each with and "
        "without prefix caching: TTFT of turns 2+, prefill tokens computed, KV bytes shipped per turn, hit rate, "
        "leaked pages",
        carry=STACK_CARRY,
        steps=(multi_turn_step("colocated", 240), multi_turn_step("disaggregated", 310)),
        reproduces=("issue 25 goals: TTFT p50 of turns 2+ >= 3x lower than without caching; KV bytes per turn <= "
                    "the new tokens' KV; zero leaked pages",)),
    "prefill-prefix": Suite(
        "the prefill worker's engine alone on the H200 (gpt-oss-20b, the multi-turn suite's prefill settings): 352 "
        "tokens after a cached 3,296-token prefix against 352 and 3,648 uncached, compute time split into host "
        "before launch / launch / hooks / wait and the GPU span, with the sender's run-ahead bound 2 and none; one "
        "cached prefill profiled (kernels, their device time; cProfile of the host launch)",
        carry=STACK_CARRY,
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
        carry=STACK_CARRY,
        steps=(step("piecewise-gpu-test", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                          "tests/integration/test_piecewise_gpu.py", 100, summary=PYTEST),
               *(step(f"prefill-prefix-{tag}", PREFILL_PREFIX + f"--reps 5 --layers-ahead 2 {flag} "
                                                                "--out {out}/prefill_prefix.json",
                      150, summary=r"^P=|^cached|^uncached|Error")
                 for tag, flag in (("eager", "--no-piecewise-graphs"), ("piecewise", "--piecewise-graphs")))),
        reproduces=("prefill-prefix-2 (2026-12-03): cached P+N (N = 352) 36 ms of compute for 11.7 ms of kernels",)),
    # Every served figure so far is greedy (loadgen sent temperature 0); OpenAI clients default to 1. At
    # temperature > 0 the sampler hashes exponential noise over the whole [B, 201088] logits, outside the graph.
    "served-sampled": Suite(
        "the served stack on one H200 (20b random weights, disaggregated: one prefill and one decode worker with "
        "CUDA graphs sharing the GPU), 64 streams of 1024 in / 512 out at once, greedy then temperature 1: what "
        "sampling costs per decode step",
        carry=STACK_CARRY,
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
        carry=STACK_CARRY,
        steps=(multi_turn_step("colocated", 240, name="colocated-1", extra="--colocated-decode 1 "),),
        reproduces=(COLOCATED_GOAL,)),
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
        carry=STACK_CARRY,
        steps=(step("loop-gpu-tests", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider "
                                      "tests/integration/test_async_decode_gpu.py", 120,
                    summary=PYTEST + r"|collected first|first-token steps"),
               colocated_pw_step("colocated-1-pw", 200),
               colocated_pw_step("colocated-1-pw-wait", 200, "--first-token-wait-ms 3 ")),
        reproduces=(COLOCATED_GOAL,)),
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
        carry=STACK_CARRY,
        steps=(step("piecewise-gpu-tests", "{py} -m pytest -q -s -m gpu -p no:cacheprovider "
                                           "tests/integration/test_piecewise_gpu.py", 130, summary=PYTEST),
               step("mixed-step", MIXED_STEP + "--turns 5 --forwards piecewise-pow2,piecewise-fine,piecewise-sliding,"
                                               "piecewise-all --orders ready --mixed-roles decode "
                                               "--out {out}/mixed_step.json", 130,
                    summary=MIXED_STEP_SUMMARY),
               colocated_pw_step("colocated-1-graphed-fine", 150,
                                 "--piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 "),
               colocated_pw_step("colocated-1-pw", 150)),
        reproduces=(COLOCATED_GOAL,
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
        carry=STACK_CARRY,
        steps=(PW_2LAYERS,
               colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-hold", 150, "--launch-hold "),
               colocated_pw_step("colocated-1-hold-bubble", 150, "--launch-hold --launch-hold-bubble 0.25 ")),
        reproduces=(COLOCATED_GOAL,
                    "multi-turn-colocated-ab-1 (2026-12-06, H100): 2.62x with the defaults")),
    # launch-hold-ab-1/2: no prompt was admitted from a hold; they reach the worker ~4-5 ms into a ~11 ms step, so
    # admission needs a mixed launch of a few ms: attention in the graphs (3.7 ms on a fast host). The same
    # served run with the defaults, the hold with attention in the graphs, and the hold with a bubble of half a
    # step (admits the islands' ~10 ms launches at the cost of an idle GPU).
    "launch-hold-graphed-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults, with --launch-hold --piecewise-graphed-attention all --piecewise-buckets fine, and with "
        "--launch-hold --launch-hold-bubble 0.5; each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-hold-graphed-fine", 150,
                                 "--launch-hold --piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 "),
               colocated_pw_step("colocated-1-hold-bubble50", 150, "--launch-hold --launch-hold-bubble 0.5 ")),
        reproduces=(COLOCATED_GOAL,
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
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-pw-clients4", 150, bench="--client-procs 4 "),
               colocated_pw_step("colocated-1-hold-graphed-bubble30", 150,
                                 "--launch-hold --launch-hold-bubble 0.3 --piecewise-graphed-attention all "
                                 "--piecewise-graphed-max-tokens 0 ")),
        reproduces=(COLOCATED_GOAL,
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
        carry=STACK_CARRY,
        steps=(PW_2LAYERS,
               colocated_pw_step("colocated-1-pw", 150, "--piecewise-buckets pow2 "),  # the default until this A/B
               colocated_pw_step("colocated-1-fine", 150, "--piecewise-buckets fine "),
               colocated_pw_step("colocated-1-hold-graphed-fine", 150,
                                 "--launch-hold --piecewise-graphed-attention all --piecewise-buckets fine "
                                 "--piecewise-graphed-max-tokens 0 ")),
        reproduces=(COLOCATED_GOAL,
                    "kernel-defaults-check-1 (2026-12-06, H100): 2.56x with the defaults")),
    # colocated-buckets-ab-1: with fine buckets a cached turn's mixed step (~245 new tokens beside ~63 decode rows at
    # ~3.6k context) still spans 15.1 ms on the GPU against a decode step's 9.9; where do the 5 ms go?
    "mixed-step-profile": Suite(
        "issue 25: the decode worker's engine (20b, the multi-turn suite's decode settings, CUDA graphs + piecewise "
        "graphs with the default buckets) with 60 sequences decoding at 3.5k context while a new turn (3,296 cached + "
        "280 new tokens) joins: torch.profiler of the mixed step, then of a decode step of the same batch",
        carry=STACK_CARRY,
        steps=(step("mixed-step", MIXED_STEP + "--turns 3 --forwards piecewise --orders ready --mixed-roles decode "
                                               "--profile --out {out}/mixed_step.json", 200,
                    summary=MIXED_STEP_SUMMARY),)),
    # launch-hold-bubble-ab-1 / colocated-buckets-ab-1 (H100): a cached turn's first token waits for the step in
    # flight, the step queued behind it and its own mixed step (~300 tokens beside ~63 decode rows: 15.1 ms on the
    # GPU against a decode step's 9.9). With --prefill-steps separate its own step is prompt-only (~250 tokens) and
    # the decode rows run in the step after it (SGLang's order).
    "prefill-steps-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with mixed "
        "steps (the default) and with --prefill-steps separate (one client process each), then separate with 4 "
        "client processes; each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-separate", 150, "--prefill-steps separate "),
               colocated_pw_step("colocated-1-separate-clients4", 150, "--prefill-steps separate ",
                                 bench="--client-procs 4 ")),
        reproduces=(COLOCATED_GOAL,
                    "colocated-buckets-ab-1 (2026-12-06, H100): 2.88x with the defaults")),
    # prefill-steps-ab-1 and launch-hold-bubble-ab-1 (H100 leases whose host was the limit): a cached turn's mixed
    # step launched in 16-18 ms of host time for ~14-18 ms of GPU work, decode steps in 3-5.7 ms (metadata 2.5-4.2).
    # Where that host time goes, per function (cProfile over 8 mixed launches and 32 decode steps).
    "mixed-host-profile": Suite(
        "issue 25: the decode worker's engine (20b, the multi-turn suite's decode settings, CUDA graphs + piecewise "
        "graphs) with 60 sequences decoding at 3.5k context while new turns (3,296 cached + 280 new tokens) join: "
        "cProfile of 8 mixed steps' iterations and 32 decode steps', us per step by function",
        carry=STACK_CARRY,
        steps=(step("mixed-step", MIXED_STEP + "--turns 3 --forwards piecewise --orders ready --mixed-roles decode "
                                               "--host-profile 8 --out {out}/mixed_step.json", 240,
                    summary=MIXED_STEP_SUMMARY),)),
    # launch-hold-bubble-ab-1 (a host-bound H100 lease): attention inside the graphs launched a cached turn's mixed step
    # in 7.6 ms against 18.2 (cached TTFT p50 46.1 vs 53.9 ms) but a 4,096-token step in 51.9 against 31.9 (the
    # cache-off side 35 ms worse). --piecewise-graphed-max-tokens keeps the graphs' attention to the small buckets.
    "graphed-small-ab": Suite(
        "issue 25: multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with the "
        "defaults, with attention inside the graphs for steps of <= 768 tokens only, and that with --launch-hold "
        "--launch-hold-bubble 0.3; each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-graphed768", 150,
                                 "--piecewise-graphed-attention all --piecewise-graphed-max-tokens 768 "),
               colocated_pw_step("colocated-1-graphed768-hold", 150,
                                 "--piecewise-graphed-attention all --piecewise-graphed-max-tokens 768 --launch-hold "
                                 "--launch-hold-bubble 0.3 ")),
        reproduces=(COLOCATED_GOAL,
                    "colocated-buckets-ab-1 (2026-12-06, H100): 2.88x with the defaults")),
    # b1-ab-1 (H100): the best batch-1 decode is FP8 QKV/O with the few-token FP8 kernel on e4m3 pages (2.540 ms at
    # 8k against the workers' defaults' 2.805); where its time goes. And issue 25's served run on e4m3 pages: a decode
    # step of ~63 sequences at ~3.6k context reads ~5.6 GB of bf16 K/V (fp8-kv-model: 8k x 64 10.95 -> 8.98 ms on
    # the H200), and a cached turn waits ~3 step periods.
    "b1-profile-fp8kv-served": Suite(
        "where a 20b batch-1 decode step at 8k goes with FP8 QKV/O, the few-token FP8 kernel and e4m3 pages (eager, "
        "torch.profiler); then multi-turn-colocated-pw's served run (64 x 8 turns, ONE decode worker, step trace) with "
        "the defaults and with e4m3 KV pages (--kv-cache-dtype fp8, both roles), each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(step("profile-b1-fp8", "{py} -m benchmarks.profile_decode --preset gpt-oss-20b --batches 1 --fp8-attention "
                                      "--linear deepgemm --kv-cache-dtype fp8 --fusions rope_store+fp8_gemv", 100,
                    summary=r"CUDA kernels per step|Error"),
               colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-kvfp8", 150, serve="--kv-cache-dtype fp8 ")),
        reproduces=(COLOCATED_GOAL, "b1-ab-1 (2026-12-06, H100): 8k x 1 replay 2.540 ms (FP8 QKV/O + fp8_gemv, e4m3)")),
    # b1-profile-fp8kv-served-1: the e4m3 served arm died in its worker's warm-up (index_copy_ on float8, fixed in
    # 786fb97). With it: the batch-1 changes (fa2 -> Triton decode for one sequence; the router inside the norm) and
    # the FlashInfer backend's split (kernels/flashinfer_plans.py) on the GPU.
    "b1-defaults-ab": Suite(
        "GPU tests (e4m3 and bf16 prefix page copies, the Triton decode backend, FlashInfer's attention tests after "
        "its split, the fused norm + router), gpt-oss-20b prefill 8k and decode replay at 8k x 1/4/64 with "
        "rope_store vs rope_store+norm_router (workers' defaults, bf16 QKV/O), disaggregated == colocated greedy tokens "
        "on FlashInfer, then multi-turn-colocated-pw's served run on e4m3 KV pages with and without prefix caching",
        carry=STACK_CARRY,
        steps=(step("gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py "
                                 "tests/kernels/test_attention_gpu.py tests/kernels/test_fusion_gpu.py "
                                 "-k 'copy_pages or triton_decode_backend or flashinfer or router'", 150, summary=PYTEST),
               step("model-20b", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 "
                                 "--contexts 8192 --batches 1,4,64 --fusions rope_store,rope_store+norm_router "
                                 "--tag gpt-oss-20b-tp1-b1-defaults", 120, summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-b1-defaults.json": "model_gpt-oss-20b-tp1-b1-defaults.json"}),
               smoke_step("flashinfer", "--attention-backend flashinfer", timeout_s=120),
               colocated_pw_step("colocated-1-kvfp8", 150, serve="--kv-cache-dtype fp8 ")),
        reproduces=("b1-ab-1 (2026-12-06, H100): 20b 8k x 1 replay 2.805 ms (FlashInfer) / 2.737 (Triton decode)",)),
    # b1-defaults-ab-1: served on e4m3 pages, mixed steps spanned 35.9 ms on the GPU (bf16 pages 20.5, another lease):
    # each decode row's whole context read back dequantised. Now such steps read the pages in place (fa2's e4m3 variant).
    "fp8kv-mixed-ab": Suite(
        "e4m3 pages' mixed steps read in place: the FP8-KV GPU tests (self-tests and real dims, whose mixed steps now "
        "take fa2's e4m3 variant under the default backend), 20b prefill 8k and decode replay at 8k x 1/64 with the "
        "2026-12-06 defaults (norm_router, one-sequence steps on the Triton decode kernel), then "
        "multi-turn-colocated-pw's served run on bf16 and on e4m3 pages, each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(step("fp8-kv-gpu-tests", "{py} -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fp8_kv_gpu.py "
                                        "-k 'self_test or real_dims or copy_pages'", 120, summary=PYTEST),
               step("model-20b", "{py} -m benchmarks.bench_model --preset gpt-oss-20b --bf16-attention --prefill-lens 8192 "
                                 "--contexts 8192 --batches 1,64 --tag gpt-oss-20b-tp1-defaults-1206", 80,
                    summary=r"^prefill|^decode ctx|FAILED|Error",
                    publish={"model_gpt-oss-20b-tp1-defaults-1206.json": "model_gpt-oss-20b-tp1-defaults-1206.json"}),
               colocated_pw_step("colocated-1-pw", 150),
               colocated_pw_step("colocated-1-kvfp8", 150, serve="--kv-cache-dtype fp8 ")),
        reproduces=(COLOCATED_GOAL, "b1-defaults-ab-1 (2026-12-06, H100): e4m3 served mixed steps 35.9 ms on the GPU")),
    # The e4m3 served path had never run disaggregated (b1-profile-fp8kv-served-1 found the colocated one crashing).
    "fp8kv-disagg": Suite(
        "e4m3 KV pages across the disaggregated stack: disaggregated == colocated greedy tokens with FlashInfer and "
        "--kv-cache-dtype fp8 on both workers, then issue 25's disaggregated multi-turn run on e4m3 pages (cache on, "
        "every prefill remote, cache off: bytes shipped, leaks)",
        carry=STACK_CARRY,
        steps=(smoke_step("fp8kv-fi", "--attention-backend flashinfer --kv-cache-dtype fp8", timeout_s=120),
               # half the KV GiB of the bf16 runs = the same tokens; the bf16 budgets (28 + 12 GiB and two 20b models)
               # do not fit an H100 beside each other (fp8kv-disagg-1: the prefill worker ran out of memory loading)
               multi_turn_step("disaggregated", 230, name="disaggregated-kvfp8",
                               serve_args="--kv-cache-dtype fp8 " + MT_SERVE_ARGS.replace(
                                   "--kv-cache-gib 28 --prefill-kv-cache-gib 12", "--kv-cache-gib 14 --prefill-kv-cache-gib 6"))),
        reproduces=("multi-turn-1 (2026-12-03, H200): disaggregated cached turns 2+ 1700 -> 100 ms (17x), bf16 pages",)),
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
        carry=STACK_CARRY,
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
    "prefix-gpu-tests": Suite(
        "issue 25: prefix caching on the GPU (FlashInfer, CUDA graphs, overlapped loop): later turns hit, "
        "tokens agree with the uncached engine, no leaks; and the overlapped loop's GPU tests with the cache on",
        carry=STACK_CARRY,
        steps=(step("prefix-gpu", "{py} -m pytest -q -rP -m gpu -p no:cacheprovider tests/integration/test_prefix_cache_gpu.py "
                                  "tests/integration/test_async_decode_gpu.py", 300, summary=PYTEST),)),
    # Issue 25's "must show" is an H200 figure; every served run since 2026-12-03 came on H100 leases (colocated 2.15-2.90x,
    # a cached turn waiting ~3 decode step periods; the bf16 budgets of two models on one GPU exceed an H100's memory).
    "issue25-h200": Suite(
        "issue 25's served figures on one H200 (20b random weights, bf16 pages, the workers' defaults): colocated with ONE "
        "decode worker (multi-turn-colocated-pw's run, step trace) and disaggregated (one prefill, one decode worker, "
        "every launch also with prefix caching off), 64 x 8 turns, 2k shared system prompt. Needs an H200 (the "
        "disaggregated KV budgets of two models on one GPU do not fit an H100): run with needs_h200. The colocated "
        "load runs in 4 client processes (one process parsing ~60 SSE events per decode step added ~4 ms to every "
        "TTFT it measured: launch-hold-bubble-ab-1)",
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-pw", 150, bench="--client-procs 4 "), multi_turn_step("disaggregated", 310)),
        reproduces=(COLOCATED_GOAL, "fp8kv-mixed-ab-1 (2026-12-06, H100): colocated 44.3 vs 113.3 ms (2.56x)")),
    # issue25-h200-1 (H200): the defaults' cached turns 2+ at 2.80x, mixed steps launched in 14.2 ms for 14.9 on the GPU;
    # graphed-small-ab-1 (H100) had attention inside the graphs of steps <= 768 tokens at 2.90x (launch 13.1 -> 3.7 ms)
    # --cuda-graphs and --piecewise-graphs default to on where the device is a GPU (engine/worker_args.cuda_graphs_on,
    # piecewise_on; 2026-12-07); before, a worker started without the flags (the Helm chart's prefill workers) ran
    # eager steps.
    "graph-defaults": Suite(
        "the workers' graph defaults on a GPU (--cuda-graphs, --piecewise-graphs on unless turned off): the "
        "disaggregated smoke (a prefill worker with its default pieces: tokens equal to colocated, pages returned), "
        "then the multi-turn load with every prefill remote (cache on, 64 x 8 turns), the prefill worker with its "
        "default and with --no-piecewise-graphs (what it ran before)",
        carry=STACK_CARRY,
        steps=(smoke_step("defaults-smoke", timeout_s=150),
               remote_prefill_step("remote-pw-default", "", 160),
               remote_prefill_step("remote-pw-off", "--no-piecewise-graphs", 160)),
        reproduces=("multi-turn-1 (2026-12-03, H200, prefill worker eager): every prefill remote, cache on, TTFT p50 "
                    "of turns 2+ 1,786 ms, a cached prefill's compute 52.8 ms for ~355 tokens",)),
    "issue25-h200-graphed": Suite(
        "issue 25's colocated run on the H200 (issue25-h200's colocated-1-pw: 64 x 8 turns, ONE decode worker, 4 client "
        "processes, step trace), with every attention call an eager island (--piecewise-graphed-attention none, the "
        "decode worker's default until 2026-12-07) and with attention inside the piecewise graphs for steps of <= 768 "
        "tokens (the default since), each with and without prefix caching",
        carry=STACK_CARRY,
        steps=(colocated_pw_step("colocated-1-islands", 150, "--piecewise-graphed-attention none ",
                                 bench="--client-procs 4 "),
               colocated_pw_step("colocated-1-graphed768", 150, "--piecewise-graphed-attention all "
                                 "--piecewise-graphed-max-tokens 768 ", bench="--client-procs 4 ")),
        reproduces=(COLOCATED_GOAL, "issue25-h200-1 (2026-12-06, H200): colocated 46.6 vs 130.6 ms (2.80x)")),
}
