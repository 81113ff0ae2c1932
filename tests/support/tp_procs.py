"""Multi-rank (`--tp N`) worker processes for the integration tests (tests/integration/test_tp_workers.py,
test_tp_followers.py): start them as `tandem` subprocesses on the CPU (KV over NIXL/UCX TCP loopback),
speak the router's wire protocol to one of them (Peer), wait until they are ready, stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from benchmarks.disagg_smoke import Peer as SmokePeer
from tests.support.ports import free_port  # not an ephemeral port: tests/support/ports.py
from wire.protocol import StatusRequest, TokenChunk, WorkerStatus, encode

STARTUP_S = 240  # the whole cluster, on a loaded 2-core machine
SHORT = [200006, 17360, 200008, 3, 99, 1234, 200007]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: str
    addr: str = ""

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def spawn(name: str, argv: list[str]) -> Proc:
    # TANDEM_IO_STALL_DUMP_S: when a worker's network thread cannot run for 2 s (what the router sees as
    # a silent worker: it marks one down after ~3 s), every thread's stack goes to the worker log, again
    # every 2 s while it lasts (a rare CI failure had a TP2 decode worker silent for ~9 s)
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1", TANDEM_IO_STALL_DUMP_S="2")
    log = tempfile.NamedTemporaryFile(prefix=f"tandem-tp-{name}-", suffix=".log", delete=False)
    return Proc(name, subprocess.Popen([sys.executable, "-m", "launcher.cli", *argv], env=env,
                                       stdout=subprocess.DEVNULL, stderr=log), log.name)


def start_worker(name: str, role: str, tp: int, ckpt: str, kv_backend: str = "nixl",
                 extra: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    p = spawn(name, [f"{role}-worker", "--checkpoint", ckpt, "--device", "cpu", "--host", "127.0.0.1",
                     "--kv-backend", kv_backend, "--max-num-seqs", "32", "--kv-cache-gib", "0.0625",
                     "--port", str(port), "--metrics-port", "0", "--tp", str(tp), "--tp-timeout-s", "30", *extra])
    p.addr = f"tcp://127.0.0.1:{port}"
    return p


class Peer(SmokePeer):
    """The smoke script's DEALER peer (one TokenChunk at a time) with the calls these tests make."""

    def ask(self, msg: object, timeout_s: float = 60.0) -> object:
        self.sock.send(encode(msg))
        return self.recv(timeout_s)

    def status(self) -> WorkerStatus:
        while self.sock.poll(0):  # late answers
            self.sock.recv()
        # Generous: on the 2-core CI machine ~7 processes share the cores (each NIXL agent's
        # progress thread spins), and a reply once took > 5 s; what is tested is the state, not latency.
        st = self.ask(StatusRequest(), 30.0)
        assert isinstance(st, WorkerStatus)
        return st

    def tokens(self, rid: str, timeout_s: float = 120.0) -> list[int]:
        out: list[int] = []
        while True:
            m = self.recv(timeout_s)
            if isinstance(m, TokenChunk) and m.request_id == rid:
                assert not m.error, m.error
                out += m.token_ids
                if m.finished:
                    return out

    def close(self) -> None:
        self.sock.close(0)


def wait_ready(procs: list[Proc], router_url: str | None, timeout_s: float) -> None:
    t_end = time.monotonic() + timeout_s
    pending = [p for p in procs if p.addr]
    while pending or router_url:
        assert time.monotonic() < t_end, f"not ready: {[p.name for p in pending]} router={router_url}"
        for p in procs:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited during start-up:\n{p.log()[-3000:]}")
        for p in list(pending):
            peer = Peer(p.addr)
            try:
                if peer.status().ready:
                    pending.remove(p)
            except TimeoutError:
                pass
            finally:
                peer.close()
        if not pending and router_url:
            try:
                with urllib.request.urlopen(router_url + "/ready", timeout=2) as r:
                    router_url = None if r.status == 200 else router_url
            except OSError:
                pass
        time.sleep(0.5)


def stop(procs: list[Proc], grace_s: float = 30.0) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()

