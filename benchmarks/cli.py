"""`tandem bench`: one entry for every benchmark. A thin dispatcher; the scripts keep their own flags.

  prefill   bench_model with decode off (--contexts "");  --tp N > 1: torchrun -m benchmarks.bench_tp
  decode    bench_model with prefill off (--prefill-lens ""); --tp N as above
  transfer  kv_transfer (GPU0 -> GPU1 over NIXL; `--devices cpu cpu` for a CPU smoke run)
  serve     the open-loop serving benchmark (serve_bench), against --url or a service it launches
  report    plots + benchmarks/results/README.md from the committed JSON (report.py)
  suite     a named GPU suite (benchmarks/suites.py): set-up, every step with its timeout, suite.json

Flags not listed here pass through unchanged, e.g.
    tandem bench prefill --preset gpt-oss-120b --tp 2 --prefill-lens 2048,8192
    tandem bench decode --preset gpt-oss-20b --contexts 8192 --batches 1,64 --print
GPU benchmarks refuse to start without the GPUs they need (one clear line, exit 2).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from common.errors import ConfigError

SUBCOMMANDS = ("prefill", "decode", "transfer", "serve", "report", "suite")


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _value(args: list[str], flag: str, default: str | None = None) -> str | None:
    """The value of `--flag V` or `--flag=V` in a pass-through argument list."""
    for i, x in enumerate(args):
        if x == flag and i + 1 < len(args):
            return args[i + 1]
        if x.startswith(flag + "="):
            return x.split("=", 1)[1]
    return default


def _has(args: list[str], flag: str) -> bool:
    return any(x == flag or x.startswith(flag + "=") for x in args)


def model_command(phase: str, tp: int, rest: list[str]) -> list[str]:
    """The bench_model / bench_tp command for one phase; the other phase is switched off unless the
    caller set its lengths explicitly."""
    off = ["--contexts", ""] if phase == "prefill" else ["--prefill-lens", ""]
    args = ([] if _has(rest, off[0]) else off) + rest
    if tp > 1:
        return ["torchrun", "--nproc-per-node", str(tp), "-m", "benchmarks.bench_tp", *args]
    return [sys.executable, "-m", "benchmarks.bench_model", *args]


def transfer_command(rest: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.kv_transfer", *rest]


def gpus_needed(sub: str, tp: int, rest: list[str]) -> int:
    """GPUs the command needs: 0 for CPU smoke runs (bench_model --device cpu, kv_transfer on cpu)."""
    if sub == "transfer":
        i = rest.index("--devices") if "--devices" in rest else -1
        devices = rest[i + 1:i + 3] if i >= 0 else ["cuda:0", "cuda:1"]
        return sum(d.startswith("cuda") for d in devices)
    if tp == 1 and _value(rest, "--device", "cuda") == "cpu":
        return 0
    return tp


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        p = argparse.ArgumentParser(prog="tandem bench", description=__doc__.split("\n\n")[0],
                                    epilog="subcommands: " + ", ".join(SUBCOMMANDS))
        p.add_argument("benchmark", choices=SUBCOMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            p.error(f"unknown benchmark {argv[0]!r}")
        print(__doc__)
        return 0 if argv else 2
    sub, rest = argv[0], argv[1:]
    if sub == "serve":
        from benchmarks.serve_bench import main as serve_main

        return serve_main(rest)
    if sub == "report":
        from benchmarks.report import main as report_main

        return report_main(rest)
    if sub == "suite":
        from benchmarks.suite_run import main as suite_main

        return suite_main(rest)
    p = argparse.ArgumentParser(prog=f"tandem bench {sub}", add_help=False)
    p.add_argument("--tp", type=int, default=1, help="GPUs (torchrun, one process each)")
    p.add_argument("--print", action="store_true", help="print the command instead of running it")
    own, rest = p.parse_known_args(rest)
    if own.tp < 1:
        raise ConfigError("--tp must be >= 1")
    if sub == "transfer" and own.tp != 1:
        raise ConfigError("transfer takes no --tp (it always moves KV GPU0 -> GPU1)")
    cmd = transfer_command(rest) if sub == "transfer" else model_command(sub, own.tp, rest)
    if own.print:
        print(shlex.join(cmd))
        return 0
    need = gpus_needed(sub, own.tp, rest)
    if need:
        have = visible_gpus()
        if have < need:
            hint = " (for a CPU smoke run: --device cpu with a tiny preset)" if sub != "transfer" else \
                " (for a CPU smoke run: --devices cpu cpu --tokens 256 --layers 4)"
            raise ConfigError(f"`tandem bench {sub}` needs {need} NVIDIA GPU(s); {have} visible{hint}")
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.call(cmd)
