"""Ports for test processes to bind later (workers, routers spawned as subprocesses).

`bind(("127.0.0.1", 0))` hands out an ephemeral port (Linux: 32768-60999), free at that moment only: until the
spawned process binds it, an outgoing connection (UCX, ZMQ, HTTP) may take it as its source port, and a second
call may return the same port. A CI run lost a module of TP-worker tests to that ("Address already in use" on a
worker's port). These come from below the ephemeral range, are checked to bind now, and are never handed out
twice by one test process.
"""

from __future__ import annotations

import random
import socket

_LOW, _HIGH = 20000, 32000
_given: set[int] = set()
_rng = random.Random()


def free_port() -> int:
    for _ in range(2000):
        port = _rng.randint(_LOW, _HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in [{_LOW}, {_HIGH}]")
