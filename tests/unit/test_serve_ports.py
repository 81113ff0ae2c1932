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
