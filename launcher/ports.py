"""Ports a local deployment's processes bind later (`tandem serve --port 0`, the served benchmarks, the tests'
services): picked here, bound by a process started after.

`bind(("127.0.0.1", 0))` hands out an ephemeral port (Linux: 32768-60999), free at that moment only: until the
spawned process binds it, an outgoing connection (UCX, ZMQ, HTTP) may take it as its source port, and a second
call may return the same port. A CI run lost a module of TP-worker tests to that ("Address already in use" on a
worker's port). These come from below the ephemeral range, are checked to bind now, and are never handed out
twice by one process. `TANDEM_PORT_RANGE=LOW-HIGH` narrows the range: the parallel test run gives each pytest
worker its own slice (tests/conftest.py), so two workers' services never pick the same port between its check and its
bind; the worker's child processes inherit it.
"""

from __future__ import annotations

import os
import random
import socket

from common.errors import ConfigError

DEFAULT_RANGE = (20000, 32000)


def _range(env: str | None) -> tuple[int, int]:
    """(low, high) from a TANDEM_PORT_RANGE value, DEFAULT_RANGE when unset."""
    if not env:
        return DEFAULT_RANGE
    try:
        low, high = (int(x) for x in env.split("-"))
    except ValueError:
        raise ConfigError(f"TANDEM_PORT_RANGE={env!r}: expected LOW-HIGH, e.g. 20000-25999") from None
    if not 1024 <= low < high <= 65535:
        raise ConfigError(f"TANDEM_PORT_RANGE={env!r}: expected 1024 <= LOW < HIGH <= 65535")
    return low, high


def port_range() -> tuple[int, int]:
    """The range ports are picked from now (read at each pick, so a test worker may set it after importing this)."""
    return _range(os.environ.get("TANDEM_PORT_RANGE"))


# A deployment's worker ports sit at these offsets from its base port (launcher.cmd_serve.build_commands):
# prefill base+100+i, decode base+200+i, their metrics +1100+i and +1200+i.
ROLE_OFFSETS = {"prefill": (100, 1100), "decode": (200, 1200)}  # role -> (port, metrics port) offsets
WORKER_OFFSETS = tuple(sorted(off for pair in ROLE_OFFSETS.values() for off in pair))


def worker_ports(base_port: int, role: str, i: int) -> tuple[int, int]:
    """(port, metrics port) of worker i of `role` ("prefill" | "decode") in a deployment at `base_port`."""
    off, metrics_off = ROLE_OFFSETS[role]
    return base_port + off + i, base_port + metrics_off + i
_given: set[int] = set()
_rng = random.Random()


def _bindable(port: int, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    with socket.socket() as s:
        if reuse:  # as the servers bind (uvicorn, ZMQ, prometheus_client): only a listener blocks, not TIME_WAIT
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def in_use(ports: dict[int, str], host: str = "127.0.0.1") -> list[tuple[int, str]]:
    """The (port, what) of `ports` another process listens on (`host`): what would fail the servers' binds.
    Connections a stopped deployment left in TIME_WAIT do not count (a restart right after Ctrl-C binds)."""
    return [(p, what) for p, what in sorted(ports.items()) if not _bindable(p, host, reuse=True)]


def free_port(host: str = "127.0.0.1") -> int:
    low, high = port_range()
    for _ in range(2000):
        port = _rng.randint(low, high)
        if port not in _given and _bindable(port, host):
            _given.add(port)
            return port
    raise ConfigError(f"no free port in [{low}, {high}]")


def free_base_port(workers_per_role: int) -> int:
    """A base port whose worker ports (WORKER_OFFSETS + i, i < workers_per_role) are all free now."""
    span = WORKER_OFFSETS[-1] + workers_per_role
    low, high = port_range()
    if high - low < span:
        raise ConfigError(f"the port range [{low}, {high}] holds no block of {span} worker ports (TANDEM_PORT_RANGE)")
    for _ in range(200):
        base = _rng.randint(low, high - span)
        ports = [base + off + i for off in WORKER_OFFSETS for i in range(workers_per_role)]
        if not _given.intersection(ports) and all(_bindable(p) for p in ports):
            _given.update(ports)
            return base
    raise ConfigError("found no free block of worker ports")
