"""The building blocks of the GPU suites (benchmarks/suites.py): Step and Suite, `step`, and the
step builders several suites share (model, disaggregation smoke, multi-turn, training sweep)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

SUITE_BUDGET_S = 560  # of the device tool's 600 s per call: set-up, the version probe and the tarball
PYTEST = r"\d+ (passed|failed|error)|no tests ran"
# what a suite running the served stack on the GPU machine carries: the site-packages, DeepGEMM's launchers, FlashInfer's
# prebuilt sink modules (benchmarks/suites.py's docstring says how each is made)
STACK_CARRY = (".whl-site", ".cache/dgcarry", ".cache/fi")


@dataclass(frozen=True, slots=True)
class Step:
    name: str  # also the step's output folder
    argv: tuple[str, ...]  # {py} and {out} are filled in when the step runs
    timeout_s: int
    summary: str = ""  # regex: the last matching log line goes into the table (default: the last line)
    background: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, argv): started first, stopped after
    env: tuple[tuple[str, str], ...] = ()
    publish: tuple[tuple[str, str], ...] = ()  # (file the step writes, name the report reads it by)
    gpus: int = 1  # skipped (and said so) where fewer GPUs are visible


def step(name: str, cmd: str, timeout_s: int, *, summary: str = "", background: dict[str, str] | None = None,
         env: dict[str, str] | None = None, publish: dict[str, str] | None = None, gpus: int = 1) -> Step:
    return Step(name, tuple(shlex.split(cmd)), timeout_s, summary,
                tuple((k, tuple(shlex.split(v))) for k, v in (background or {}).items()),
                tuple((env or {}).items()), tuple((publish or {}).items()), gpus)


@dataclass(frozen=True, slots=True)
class Suite:
    description: str
    carry: tuple[str, ...]  # the device call's carry list (ignored folders; see the module docstring)
    steps: tuple[Step, ...]
    kind: str = "nvidia-h200"  # the device tool's machine kind
    gpu: bool = True  # False: no GPU set-up (CPU suites)
    reproduces: tuple[str, ...] = ()  # committed results the suite re-measures
    budget_s: int = SUITE_BUDGET_S

    def total_timeout_s(self) -> int:
        return sum(s.timeout_s for s in self.steps)


def model_step(name: str, preset: str, prefill: str, contexts: str, batches: str, timeout_s: int,
               extra: str = "") -> Step:
    """bench_model with the workers' defaults (FlashInfer attention, bf16 QKV/O, MoE auto -> DeepGEMM);
    its JSON goes into the results report as model_<preset>-tp1-defaults.json."""
    tag = f"{preset}-tp1-defaults"
    return step(name, f"{{py}} -m benchmarks.bench_model --preset {preset} --bf16-attention --prefill-lens {prefill} "
                      f"--contexts {contexts} --batches {batches} --tag {tag} {extra}", timeout_s,
                summary=r"^decode ctx|^prefill|FAILED", publish={f"model_{tag}.json": f"model_{tag}.json"})


def smoke_step(name: str, worker_flags: str = "", timeout_s: int = 150, lengths: str = "2048,8192", burst: int = 4,
               tp: int = 1, kv: str = "ipc", decode_device: str = "cuda:0") -> Step:
    """Disaggregated == colocated on GPUs (run DG15's `smoke`): a prefill and a decode worker as real
    processes, driven through the wire protocol by benchmarks.disagg_smoke."""
    w = (f"--random-weights gpt-oss-20b --fp8 --attention-backend triton --kv-backend {kv} --metrics-port 0 "
         f"--host 127.0.0.1 --max-model-len 16384 --kv-cache-gib 12{f' --tp {tp}' if tp > 1 else ''} {worker_flags}")
    return step(name, f"{{py}} -m benchmarks.disagg_smoke --lengths {lengths} --burst {burst} "
                      f"--out {{out}}/disagg_smoke_{name}.json", timeout_s,
                summary=r"pages returned|identical=|Error",
                publish={f"disagg_smoke_{name}.json": f"disagg_smoke_{name}.json"},
                background={"prefill": f"{{py}} -m launcher.cli prefill-worker {w} --device cuda:0 --port 7100",
                            "decode": f"{{py}} -m launcher.cli decode-worker {w} --device {decode_device} --port 7200 "
                                      "--cuda-graphs --max-num-seqs 16"},
                gpus=2 if decode_device != "cuda:0" or tp > 1 else 1)


# The served benchmark (issue 23): one H200, 20b random weights, the decode worker with CUDA graphs; the
# prefill worker shares the GPU (memory split by the KV budgets). The engine reference is the JSON of
# the latest served-engine run, committed before the served-stack call (it travels with the repo).
SERVED_ARGS = ("--device cuda --fp8 --random-weights gpt-oss-20b --share-gpu --kv-backend ipc --kv-cache-gib 32 "
               "--prefill-kv-cache-gib 4 --max-num-seqs 128 --decode-args '--cuda-graphs --max-model-len 16384 "
               "--max-num-batched-tokens 4096' --prefill-args '--max-model-len 16384'")
SERVED_MODEL_JSON = "benchmarks/results/2026-12-02/served-engine/model-20b/model_gpt-oss-20b-tp1-defaults.json"

TP = "{py} -m torch.distributed.run --nproc-per-node 2 -m benchmarks.bench_tp --bf16-attention"

# Prefix caching (issue 25): multi-turn conversations on the served stack, one H200, with and without the
# cache. The prefill worker gets room to cache prompts too; a conversation is <= 2048 + 8 x 500 tokens.
MT_SERVE_ARGS = ("--device cuda --fp8 --random-weights gpt-oss-20b --share-gpu --kv-backend ipc --kv-cache-gib 28 "
                 "--prefill-kv-cache-gib 12 --max-num-seqs 128 --decode-args '--cuda-graphs --max-model-len 16384 "
                 "--max-num-batched-tokens 4096' --prefill-args '--max-model-len 16384'")


def multi_turn_step(mode: str, timeout_s: int, name: str = "", extra: str = "", serve_args: str = MT_SERVE_ARGS
                    ) -> Step:
    """64 conversations x 8 turns, a 2k shared system prompt, 100-300 new user tokens and 100-200 answer
    tokens per turn; each mode launched with and without prefix caching (disaggregated also with every
    prefill remote: shipping only the pages decode lacks). Each launch first runs 8 warm-up
    conversations (another seed): a fresh server's first shapes compile kernels, which the first
    launch otherwise paid in its TTFT (multi-turn-1)."""
    return step(name or mode, f"{{py}} -m launcher.cli bench serve --multi-turn --launch {mode} --compare-caching "
                      "--conversations 64 --turns 8 --system-len 2048 --user-len 100:300 --output-len 100:200 --warmup 8 "
                      "--num-prefill 1 --num-decode 1 --request-timeout-s 200 --ready-timeout-s 150 "
                      f"{extra}--out {{out}}/serve_multi_turn_{name or mode}.json --serve-args "
                      + shlex.quote(serve_args),
                timeout_s, summary=r"cache|failed|Error|Traceback")


def remote_prefill_step(name: str, prefill_flags: str, timeout_s: int) -> Step:
    """The multi-turn load (64 x 8 turns, 2k shared system prompt, 4 client processes) disaggregated with prefix
    caching and every prefill on the one prefill worker (--remote-prefill-min-tokens 0): a cached turn's TTFT is
    its remote prefill of a few hundred tokens, which the prefill worker's flags (`prefill_flags`) decide."""
    # KV budgets that fit two 20b workers on an 80 GB H100 as well (28 + 12 GiB ran out of memory there): 64
    # conversations of ~4k tokens need ~13 GiB of decode pages
    serve = MT_SERVE_ARGS
    prefill_args = "--prefill-args '--max-model-len 16384'"
    for old, new in ((prefill_args, prefill_args[:-1] + f" {prefill_flags}'"),
                     ("--kv-cache-gib 28 --prefill-kv-cache-gib 12", "--kv-cache-gib 18 --prefill-kv-cache-gib 5")):
        assert old in serve, f"MT_SERVE_ARGS no longer holds {old!r}"
        serve = serve.replace(old, new)
    return step(name, "{py} -m launcher.cli bench serve --multi-turn --launch disaggregated --conversations 64 "
                      "--turns 8 --system-len 2048 --user-len 100:300 --output-len 100:200 --warmup 8 --num-prefill 1 "
                      "--num-decode 1 --request-timeout-s 200 --ready-timeout-s 150 --client-procs 4 "
                      f"--out {{out}}/serve_multi_turn_{name}.json --serve-args "
                      + shlex.quote(serve + " --remote-prefill-min-tokens 0"),
                timeout_s, summary=r"disaggregated|failed|Error|Traceback")


def sweep_step(flags: str, timeout_s: int, **kw) -> Step:
    """training.sweep (the demo model, issue 28) with `flags`; its summary is the winner line."""
    return step("sweep", "{py} -m training.sweep --out {out} " + flags, timeout_s, summary=r"^best|Error|Traceback",
                **kw)


# Issue 27's launch-bound fusions (kernels.registry.Fusion), measured against each other on one loaded model:
# all off (the workers' defaults), each alone, all on.
FUSION_AB = "off,rope_store,norm_router,norm_quant,on"
