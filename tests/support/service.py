"""Start a real service (router + workers as separate processes) for end-to-end tests."""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import zmq

from launcher.cmd_serve import build_commands, shutdown
from launcher.ports import free_base_port, free_port
from wire.protocol import StatusRequest, WorkerStatus, decode, encode


@dataclass
class Service:
    url: str
    procs: list[subprocess.Popen]  # prefill workers, decode workers, the router
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    cmds: list[list[str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)

    def log(self, i: int) -> str:
        with open(self.logs[i], errors="replace") as f:
            return f.read()

    def restart(self, i: int) -> subprocess.Popen:
        """Start process i again with its own command line (same address and ports)."""
        assert self.procs[i].poll() is not None, "stop it first"
        with open(self.logs[i], "ab") as f:
            self.procs[i] = subprocess.Popen(self.cmds[i], env=self.env, stdout=subprocess.DEVNULL, stderr=f)
        return self.procs[i]

    def status(self, addr: str, timeout_s: float = 5.0) -> WorkerStatus:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        try:
            s.send(encode(StatusRequest()))
            if not s.poll(int(timeout_s * 1000)):
                raise TimeoutError(addr)
            return decode(s.recv())
        finally:
            s.close(0)

    def assert_no_leaks(self, timeout_s: float = 10.0) -> None:
        t_end = time.monotonic() + timeout_s
        while True:
            sts = [self.status(a) for a in self.prefill + self.decode]
            leaks = [s for s in sts if s.kv_free_pages != s.kv_total_pages
                     or s.kv_free_sliding_pages != s.kv_total_sliding_pages or s.running or s.queue_depth]
            if not leaks:
                return
            if time.monotonic() > t_end:
                raise AssertionError(f"pages not returned: {leaks}")
            time.sleep(0.2)

    def stop(self) -> None:
        shutdown(self.procs, grace_s=10)


def start_service(checkpoint: str, *, num_prefill: int = 1, num_decode: int = 1, colocated: bool = False,
                  model_name: str = "m", extra_router: list[str] | None = None, timeout_s: float = 120,
                  max_num_seqs: int = 32, kv_cache_gib: float = 0.0625, extra_prefill: list[str] | None = None,
                  extra_decode: list[str] | None = None, kv_cache_dtype: str = "auto",
                  kv_scale_calibration: int = 0) -> Service:
    """kv_cache_gib 0: the workers' default budget (what `tandem serve` uses)."""
    base, port = free_base_port(max(num_prefill, num_decode)), free_port()
    a = argparse.Namespace(device="cpu", host="127.0.0.1", kv_backend="nixl", max_num_seqs=max_num_seqs, fp8=False,
                           kv_cache_gib=kv_cache_gib, num_prefill=0 if colocated else num_prefill, num_decode=num_decode,
                           base_port=base, port=port, model_name=model_name, colocated=colocated,
                           prefill_tp=1, decode_tp=1, decode_moe_mode="tp", kv_cache_dtype=kv_cache_dtype,
                           kv_scale_calibration=kv_scale_calibration)
    cmds = build_commands(a, checkpoint)
    cmds[-1] += ["--poll-interval-s", "0.25"] + (extra_router or [])  # (a later flag wins)
    for c in cmds[:a.num_prefill]:
        c += extra_prefill or []
    for c in cmds[a.num_prefill:-1]:
        c += extra_decode or []
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
    logs = [tempfile.NamedTemporaryFile(prefix=f"tandem-{c[3]}-", suffix=".log", delete=False) for c in cmds]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=f) for c, f in zip(cmds, logs)]
    svc = Service(f"http://127.0.0.1:{port}", procs,
                  [f"tcp://127.0.0.1:{base + 100 + i}" for i in range(a.num_prefill)],
                  [f"tcp://127.0.0.1:{base + 200 + i}" for i in range(num_decode)], cmds, env, [f.name for f in logs])
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            err = open(logs[procs.index(dead[0])].name, errors="replace").read()[-3000:]
            svc.stop()
            raise RuntimeError(f"{dead[0].args[3]} exited during start-up:\n{err}")
        try:
            with urllib.request.urlopen(svc.url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return svc
        except OSError:
            pass
        time.sleep(0.3)
    svc.stop()
    raise TimeoutError("service not ready")


