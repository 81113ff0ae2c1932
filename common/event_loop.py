"""Which asyncio implementation the router and the load client run on: uvloop and httptools when
installed (dependencies of tandem), asyncio's own loop and h11 otherwise or with
TANDEM_ROUTER_LOOP=asyncio (the A/B of the multi-turn suite, multi-turn-colocated-pw-7/8)."""

from __future__ import annotations

import importlib.util
import os


def loop_and_parser() -> tuple[str, str]:
    """(event loop, HTTP parser) as uvicorn names them: ("uvloop" | "asyncio", "httptools" | "h11")."""
    fast = os.environ.get("TANDEM_ROUTER_LOOP", "auto") != "asyncio"
    return ("uvloop" if fast and importlib.util.find_spec("uvloop") else "asyncio",
            "httptools" if fast and importlib.util.find_spec("httptools") else "h11")
