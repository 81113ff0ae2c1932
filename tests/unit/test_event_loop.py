"""common/event_loop.py: the router's and the load client's (event loop, HTTP parser) choice."""

from __future__ import annotations

import importlib.util

from common.event_loop import loop_and_parser


def test_fast_pair_when_installed_and_plain_pair_when_asked(monkeypatch):
    have = {name: importlib.util.find_spec(name) is not None for name in ("uvloop", "httptools")}
    monkeypatch.delenv("TANDEM_ROUTER_LOOP", raising=False)
    assert loop_and_parser() == ("uvloop" if have["uvloop"] else "asyncio", "httptools" if have["httptools"] else "h11")
    monkeypatch.setenv("TANDEM_ROUTER_LOOP", "asyncio")
    assert loop_and_parser() == ("asyncio", "h11")


def test_plain_pair_when_missing(monkeypatch):
    monkeypatch.delenv("TANDEM_ROUTER_LOOP", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert loop_and_parser() == ("asyncio", "h11")
