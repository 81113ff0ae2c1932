"""`tandem prefill-worker`: flags -> (every TP rank) engine parts + KV sender -> rank 0 runs the
PrefillServer loop; with --tp N, ranks 1..N-1 follow it (engine.tp)."""

from __future__ import annotations

import argparse

from common.errors import ConfigError
from engine.worker_args import add_worker_args, worker_id
from engine.worker_main import build_parts, exit_now, maybe_warm_up, serve, transfer_config
from engine.tp.group import RankGroup
from engine.tp.proxies import RankParts, lead
from kv_transfer.interface import new_epoch
from prefill_worker.engine import PrefillEngine
from prefill_worker.server import PrefillServer


def setup_rank(a: argparse.Namespace, wid: str, group: RankGroup) -> RankParts:
    """Runs on every TP rank, in the same order (the agreements are collectives)."""
    from kv_transfer.factory import TransferBackend, create_sender

    parts = build_parts(a, "prefill", group)
    return RankParts(parts, sender=create_sender(TransferBackend(a.kv_backend), parts.pool,
                                                 transfer_config(a, parts, wid, group.rank)))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem prefill-worker", description="batch-1 prefill worker")
    add_worker_args(p, port=7100, metrics_port=9100)
    a = p.parse_args(argv)
    if a.kv_backend == "none":
        raise ConfigError("a prefill worker needs a KV transfer backend (nixl or loopback)")
    wid, epoch = worker_id(a, "prefill"), new_epoch()
    with RankGroup.launch(a, "prefill", wid, setup_rank) as group:
        rp = lead(group, setup_rank(a, wid, group))
        maybe_warm_up(a, rp.parts)
        assert rp.sender is not None
        server = PrefillServer(PrefillEngine(rp.parts, rp.sender), None, wid, epoch, a.drain_timeout_s)
        try:
            code = serve(a, server, f"tcp://{a.host}:{a.port}")
        finally:
            rp.sender.close()
    exit_now(code)
