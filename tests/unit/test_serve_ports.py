"""`tandem serve` checks every port its processes will bind before it starts any (launcher/cmd_serve.py
check_ports): a port another process holds is a ConfigError naming it and the flag that moves it."""

from __future__ import annotations

import argparse
import re
import socket

import pytest

from common.errors import ConfigError
from launcher import ports
from launcher.cmd_serve import check_ports


def _args(port: int, base: int) -> argparse.Namespace:
    return argparse.Namespace(host="127.0.0.1", port=port, base_port=base, num_prefill=1, num_decode=2)


def test_free_ports_pass_and_a_held_one_is_named():
    base = ports.free_base_port(2)
    router = ports.free_port()
    check_ports(_args(router, base))
    for held, what in ((router, "router, --port"), (base + 201, "decode worker 1, --base-port + 201"),
                       (base + 1100, "prefill worker 0 metrics, --base-port + 1100")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", held))
            s.listen()
            with pytest.raises(ConfigError, match=rf"{held} \({re.escape(what)}\).*--port {router + 1} --base-port"):
                check_ports(_args(router, base))
    check_ports(_args(router, base))  # released: free again


def test_connections_left_in_time_wait_do_not_count():
    """A deployment stopped a moment ago leaves its servers' closed connections in TIME_WAIT; the servers
    bind with SO_REUSEADDR, so a restart works and the check must not refuse it."""
    port = ports.free_port()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server's end closes first: it waits in TIME_WAIT
    cli.close()
    srv.close()
    assert not ports._bindable(port)  # a plain bind would still fail here
    assert ports.in_use({port: "metrics"}) == []


def test_port_range_from_the_environment():
    """TANDEM_PORT_RANGE narrows the range ports are picked from (each parallel test worker takes a slice); a malformed
    one is a ConfigError naming it; under pytest-xdist this worker's ports come from its own slice."""
    import os

    assert ports._range(None) == (20000, 32000) and ports._range("21000-22999") == (21000, 22999)
    for bad in ("21000", "a-b", "22000-21000", "80-2000"):
        with pytest.raises(ConfigError, match="TANDEM_PORT_RANGE"):
            ports._range(bad)
    if "TANDEM_PORT_RANGE" in os.environ:
        low, high = ports.port_range()
        assert low <= ports.free_port() <= high and low <= ports.free_base_port(2) <= high
