"""`tandem serve`: router + N prefill + M decode worker processes on this machine, one command.

The embedded default is the demo model (model/demo: a tiny gpt-oss trained to answer, written once
into ~/.cache/tandem/checkpoints in the HF layout) on the CPU, one prefill and one decode worker, KV
over NIXL (UCX over TCP loopback). Waits until the router reports ready, prints the URL, and on Ctrl-C
(or SIGTERM) drains and stops every process it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from common.errors import ConfigError, WorkerUnavailable

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_base_port(workers_per_role: int) -> int:
    """A --base-port whose worker ports (base+100+i, +200+i and metrics +1100+i, +1200+i, see
    build_commands) are all free now."""
    for _ in range(100):
        base = free_port() % 20000 + 20000
        ports = [base + off + i for off in (100, 200, 1100, 1200) for i in range(workers_per_role)]
        if all(_port_free(p) for p in ports):
            return base
    raise ConfigError("found no free block of worker ports")


def worker_flags(a: argparse.Namespace, checkpoint: str, *, device: str, kv_backend: str, tp: int,
                 moe_mode: str) -> list[str]:
    """The flags every worker of a local deployment shares (tandem serve, tandem ray-launch)."""
    flags = ["--checkpoint", checkpoint, "--device", device, "--host", a.host, "--kv-backend", kv_backend,
             "--max-num-seqs", str(a.max_num_seqs), "--tp", str(tp), "--moe-mode", moe_mode]
    if a.fp8:
        flags.append("--fp8")
    if a.kv_cache_gib:
        flags += ["--kv-cache-gib", str(a.kv_cache_gib)]
    return flags


def build_commands(a: argparse.Namespace, checkpoint: str) -> list[list[str]]:
    exe = [sys.executable, "-m", "launcher.cli"]
    gpu = a.device.startswith("cuda")
    next_gpu = 0

    def device(tp: int) -> str:  # on GPUs each worker takes the next tp devices (rank r on base + r)
        nonlocal next_gpu
        if not gpu:
            return a.device
        base, next_gpu = next_gpu, next_gpu + tp
        return f"cuda:{base}"

    cmds = []
    prefill, decode = [], []
    for i in range(a.num_prefill):
        port = a.base_port + 100 + i
        prefill.append(f"tcp://{a.host}:{port}")
        flags = worker_flags(a, checkpoint, device=device(a.prefill_tp), kv_backend=a.kv_backend, tp=a.prefill_tp,
                             moe_mode="tp")
        cmds.append(exe + ["prefill-worker", *flags, "--port", str(port), "--metrics-port", str(a.base_port + 1100 + i)])
    for i in range(a.num_decode):
        port = a.base_port + 200 + i
        decode.append(f"tcp://{a.host}:{port}")
        flags = worker_flags(a, checkpoint, device=device(a.decode_tp), kv_backend="none" if a.colocated else a.kv_backend,
                             tp=a.decode_tp, moe_mode=a.decode_moe_mode)
        cmds.append(exe + ["decode-worker", *flags, "--port", str(port), "--metrics-port", str(a.base_port + 1200 + i)])
    router = exe + ["router", "--host", a.host, "--port", str(a.port), "--model-name", a.model_name]
    for addr in prefill:
        router += ["--prefill", addr]
    for addr in decode:
        router += ["--decode", addr]
    if a.colocated:
        router.append("--colocated")
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
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--prefill-tp", type=int, default=1, help="GPUs (processes) per prefill worker")
    p.add_argument("--decode-tp", type=int, default=1, help="GPUs (processes) per decode worker")
    p.add_argument("--decode-moe-mode", choices=["tp", "ep"], default="tp",
                   help="ep: whole experts per rank, one all-reduce as combine (the seed's EP4-TP4)")
    p.add_argument("--ready-timeout-s", type=float, default=300)
    a = p.parse_args(argv)
    if a.num_decode < 1:
        raise ConfigError("--num-decode must be >= 1")
    if a.colocated:
        a.num_prefill = 0
    if a.checkpoint is None:
        from model.checkpoint_io import ensure_demo_checkpoint

        a.checkpoint = str(ensure_demo_checkpoint(DEFAULT_CACHE))
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
        shutdown(procs)
    return 0


def shutdown(procs: list[subprocess.Popen], grace_s: float = 20.0) -> None:
    """Router first (stops new traffic), then workers drain; kill whatever outlives the grace."""
    for pr in reversed(procs):
        if pr.poll() is None:
            pr.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    for pr in procs:
        try:
            pr.wait(max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()
