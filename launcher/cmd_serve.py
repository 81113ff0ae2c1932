"""`tandem serve`: router + N prefill + M decode worker processes on this machine, one command.

The embedded default is the demo model (model/demo: a tiny gpt-oss trained to answer, written once
into ~/.cache/tandem/checkpoints in the HF layout) on the CPU, one prefill and one decode worker, KV
over NIXL (UCX over TCP loopback). Waits until the router reports ready, prints the URL, and on Ctrl-C
(or SIGTERM) drains and stops every process it started: the router first (it answers new requests
with 503 and gives those in flight up to --drain-timeout-s, then ends them with "abort"), then the
workers; each process gets the drain time plus a margin before it is killed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.errors import ConfigError, WorkerUnavailable
from launcher import ports

DEFAULT_CACHE = Path.home() / ".cache" / "tandem" / "checkpoints"


def worker_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if not device.startswith("cuda"):
        # UCX over TCP on loopback: shared-memory-only transports fail to create the backend here.
        env.setdefault("UCX_TLS", "tcp")
        env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        for p in procs:
            if p.poll() is not None:
                raise WorkerUnavailable(f"{' '.join(p.args[:3])} exited with code {p.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise WorkerUnavailable(f"the service was not ready within {timeout_s:.0f} s")


def worker_flags(a: argparse.Namespace, checkpoint: str, *, device: str, kv_backend: str, tp: int,
                 moe_mode: str, kv_cache_gib: float | None = None) -> list[str]:
    """The flags every worker of a local deployment shares (tandem serve, tandem ray-launch)."""
    flags = ["--device", device, "--host", a.host, "--kv-backend", kv_backend,
             "--max-num-seqs", str(a.max_num_seqs), "--tp", str(tp), "--moe-mode", moe_mode]
    if getattr(a, "random_weights", None):  # generated on the worker's device, no checkpoint
        flags += ["--random-weights", a.random_weights]
    else:
        flags += ["--checkpoint", checkpoint]
    if a.fp8:
        flags.append("--fp8")
    flags += ["--drain-timeout-s", str(getattr(a, "drain_timeout_s", 30.0))]
    gib = kv_cache_gib or a.kv_cache_gib
    if gib:
        flags += ["--kv-cache-gib", str(gib)]
    if getattr(a, "kv_cache_dtype", "auto") != "auto":  # both roles alike: the KV handshake compares them
        flags += ["--kv-cache-dtype", a.kv_cache_dtype]
    if getattr(a, "kv_scale_calibration", 0):
        flags += ["--kv-scale-calibration", str(a.kv_scale_calibration)]
    if not getattr(a, "enable_prefix_caching", True):
        flags.append("--no-enable-prefix-caching")
    return flags


def build_commands(a: argparse.Namespace, checkpoint: str) -> list[list[str]]:
    exe = [sys.executable, "-m", "launcher.cli"]
    gpu = a.device.startswith("cuda")
    next_gpu = 0

    def device(tp: int) -> str:  # on GPUs each worker takes the next tp devices (rank r on base + r)
        nonlocal next_gpu
        if not gpu or getattr(a, "share_gpu", False):
            return a.device
        base, next_gpu = next_gpu, next_gpu + tp
        return f"cuda:{base}"

    cmds = []
    prefill, decode = [], []
    for i in range(a.num_prefill):
        port, metrics_port = ports.worker_ports(a.base_port, "prefill", i)
        prefill.append(f"tcp://{a.host}:{port}")
        flags = worker_flags(a, checkpoint, device=device(a.prefill_tp), kv_backend=a.kv_backend, tp=a.prefill_tp,
                             moe_mode="tp", kv_cache_gib=getattr(a, "prefill_kv_cache_gib", None))
        cmds.append(exe + ["prefill-worker", *flags, "--port", str(port), "--metrics-port", str(metrics_port),
                           *shlex.split(getattr(a, "prefill_args", "") or "")])
    for i in range(a.num_decode):
        port, metrics_port = ports.worker_ports(a.base_port, "decode", i)
        decode.append(f"tcp://{a.host}:{port}")
        flags = worker_flags(a, checkpoint, device=device(a.decode_tp), kv_backend="none" if a.colocated else a.kv_backend,
                             tp=a.decode_tp, moe_mode=a.decode_moe_mode)
        cmds.append(exe + ["decode-worker", *flags, "--port", str(port), "--metrics-port", str(metrics_port),
                           *shlex.split(getattr(a, "decode_args", "") or "")])
    router = exe + ["router", "--host", a.host, "--port", str(a.port), "--model-name", a.model_name,
                    "--drain-timeout-s", str(getattr(a, "drain_timeout_s", 30.0))]
    for addr in prefill:
        router += ["--prefill", addr]
    for addr in decode:
        router += ["--decode", addr]
    if a.colocated:
        router.append("--colocated")
    if getattr(a, "remote_prefill_min_tokens", None) is not None:
        router += ["--remote-prefill-min-tokens", str(a.remote_prefill_min_tokens)]
    router += shlex.split(getattr(a, "router_args", "") or "")
    return cmds + [router]


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem serve", description="run router + workers on this machine")
    p.add_argument("--checkpoint", default=None, help="HF-layout directory (default: the embedded demo model)")
    p.add_argument("--model-name", default="gpt-oss-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp8", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--base-port", type=int, default=7000, help="workers use base+100+i (prefill), base+200+i (decode)")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="no prefill workers: decode workers prefill")
    p.add_argument("--kv-backend", default="nixl", choices=["nixl", "ipc", "loopback"],
                   help="ipc: NIXL control plane, KV bytes copied straight into the decode worker's "
                        "IPC-mapped pools (workers on this machine)")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp8", "fp32"],
                   help="every worker's KV pages (fp8: e4m3, half the bytes)")
    p.add_argument("--kv-scale-calibration", type=int, default=0, metavar="N",
                   help="FP8 KV: scales from N built-in prompts at start-up (every worker alike)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prefill-tp", type=int, default=1, help="GPUs (processes) per prefill worker")
    p.add_argument("--decode-tp", type=int, default=1, help="GPUs (processes) per decode worker")
    p.add_argument("--decode-moe-mode", choices=["tp", "ep"], default="tp",
                   help="ep: whole experts per rank, one all-reduce as combine (the seed's EP4-TP4)")
    p.add_argument("--random-weights", default=None, metavar="PRESET",
                   help="full-size random weights generated on each worker's device instead of a checkpoint "
                        "(benchmarks), e.g. gpt-oss-20b")
    p.add_argument("--share-gpu", action="store_true",
                   help="every worker on --device (one GPU, memory split by the KV budgets) instead of one "
                        "device per worker rank")
    p.add_argument("--prefill-kv-cache-gib", type=float, default=None, help="prefill workers' KV budget "
                   "(default: --kv-cache-gib)")
    p.add_argument("--prefill-args", default="", help="extra flags for every prefill worker, one string")
    p.add_argument("--decode-args", default="", help="extra flags for every decode worker, one string")
    p.add_argument("--router-args", default="", help="extra flags for the router, one string")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="workers keep finished requests' KV pages, content-addressed, for later prompts that "
                        "share a prefix (every worker; the router routes by it)")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=None,
                   help="router: shorter uncached suffixes on a decode worker that holds the prefix prefill "
                        "there (default: the router's measured default; 0 = always remote)")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    p.add_argument("--drain-timeout-s", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM: how long requests in flight may finish before they end with 'abort'")
    a = p.parse_args(argv)
    if a.num_decode < 1:
        raise ConfigError("--num-decode must be >= 1")
    if a.colocated:
        a.num_prefill = 0
    if a.checkpoint is None and not a.random_weights:
        from model.checkpoint_io import ensure_checkpoint, ensure_demo_checkpoint
        from model.demo import DEMO_FILE, PRODUCED_BY

        if DEMO_FILE.exists():
            a.checkpoint = str(ensure_demo_checkpoint(DEFAULT_CACHE))
        else:
            # A tree without the trained demo weights serves the random tiny model. It never emits a
            # stop token, so a request without max_tokens would run to the context's end: the router's
            # default max_tokens becomes 64 (a request may still ask for more).
            print(f"note: {DEMO_FILE.name} is not in this tree (trained by {PRODUCED_BY}); serving the random "
                  "tiny model, whose replies are noise, with a default max_tokens of 64", file=sys.stderr)
            a.checkpoint = str(ensure_checkpoint("tiny", DEFAULT_CACHE))
            a.router_args = f"--default-max-tokens 64 {getattr(a, 'router_args', '') or ''}"
    check_ports(a)
    env = worker_env(a.device)
    procs = [subprocess.Popen(cmd, env=env) for cmd in build_commands(a, a.checkpoint)]
    stop = {"now": False}

    def _stop(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, _stop)
    url = f"http://{a.host}:{a.port}"
    try:
        _wait_ready(url, procs, a.ready_timeout_s)
        print(f"tandem is serving {a.model_name} at {url}/v1  ({a.num_prefill} prefill + {a.num_decode} decode "
              f"workers on {a.device}; Ctrl-C stops)", flush=True)
        while not stop["now"] and all(pr.poll() is None for pr in procs):
            time.sleep(0.5)
        dead = [pr for pr in procs if pr.poll() is not None]
        if dead and not stop["now"]:
            print(f"a process exited ({' '.join(dead[0].args[3:5])}, code {dead[0].returncode}); stopping", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(procs, drain_s=a.drain_timeout_s)
    return 0


def check_ports(a: argparse.Namespace) -> None:
    """Every port the deployment binds (build_commands) is free, or a ConfigError before anything starts: a
    second `tandem serve` used to start its workers and fail ~20 s later on the router's bind."""
    want = {a.port: "router, --port"}
    for role, n in (("prefill", a.num_prefill), ("decode", a.num_decode)):
        for i in range(n):
            port, metrics_port = ports.worker_ports(a.base_port, role, i)
            want[port] = f"{role} worker {i}, --base-port + {port - a.base_port}"
            want[metrics_port] = f"{role} worker {i} metrics, --base-port + {metrics_port - a.base_port}"
    busy = ports.in_use(want, a.host)
    if busy:
        taken = ", ".join(f"{p} ({what})" for p, what in busy)
        raise ConfigError(f"in use on {a.host} (another tandem serve?): {taken}. Pick free ones, e.g. "
                          f"--port {a.port + 1} --base-port {a.base_port + 500} "
                          f"(make serve ARGS='--port {a.port + 1} --base-port {a.base_port + 500}')")


def shutdown(procs: list[subprocess.Popen], grace_s: float = 20.0, drain_s: float = 0.0) -> None:
    """Router first (the last process: it stops new traffic and drains up to `drain_s`), then the
    workers (whatever it aborted is gone from them by then); kill whatever outlives drain + grace."""
    for group in (procs[-1:], procs[:-1]):
        for pr in group:
            if pr.poll() is None:
                pr.send_signal(signal.SIGTERM)
        t_end = time.monotonic() + drain_s + grace_s
        for pr in group:
            try:
                pr.wait(max(0.1, t_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()
