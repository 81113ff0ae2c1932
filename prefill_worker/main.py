"""`tandem prefill-worker`: flags -> engine parts + KV sender -> PrefillServer loop."""

from __future__ import annotations

import argparse

from common.errors import ConfigError
from common.worker_args import add_worker_args, worker_id
from common.worker_main import build_parts, serve, transfer_config
from kv_transfer.interface import new_epoch
from prefill_worker.engine import PrefillEngine
from prefill_worker.server import PrefillServer


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem prefill-worker", description="batch-1 prefill worker")
    add_worker_args(p, port=7100, metrics_port=9100)
    a = p.parse_args(argv)
    if a.kv_backend == "none":
        raise ConfigError("a prefill worker needs a KV transfer backend (nixl or loopback)")
    wid, epoch = worker_id(a, "prefill"), new_epoch()
    parts = build_parts(a, "prefill")
    from kv_transfer.factory import TransferBackend, create_sender

    tx = create_sender(TransferBackend(a.kv_backend), parts.pool, transfer_config(a, parts, wid))
    server = PrefillServer(PrefillEngine(parts, tx), None, wid, epoch)
    try:
        return serve(a, server, f"tcp://{a.host}:{a.port}")
    finally:
        tx.close()
