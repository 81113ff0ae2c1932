"""`tandem decode-worker`: flags -> engine parts + KV receiver -> DecodeServer loop."""

from __future__ import annotations

import argparse

from common.worker_args import add_worker_args, worker_id
from common.worker_main import build_parts, serve, transfer_config
from decode_worker.engine import DecodeEngine
from decode_worker.server import DecodeServer
from kv_transfer.interface import new_epoch


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem decode-worker", description="continuous-batching decode worker")
    add_worker_args(p, port=7200, metrics_port=9200)
    a = p.parse_args(argv)
    wid, epoch = worker_id(a, "decode"), new_epoch()
    parts = build_parts(a, "decode")
    rx = None
    if a.kv_backend != "none":
        from kv_transfer.factory import TransferBackend, create_receiver

        rx = create_receiver(TransferBackend(a.kv_backend), parts.pool, transfer_config(a, parts, wid))
        rx.set_rank_endpoints((rx.endpoint,), (rx.epoch,))
    if a.cuda_graphs and a.device.startswith("cuda"):
        from decode_worker.runner import CudaGraphDecoder

        graphs = CudaGraphDecoder(parts.model, parts.pool, parts.kv, a.max_num_seqs, a.max_model_len)
        graphs.capture()
        parts.runner.graphs = graphs
    server = DecodeServer(DecodeEngine(parts, rx), None, wid, epoch)
    try:
        return serve(a, server, f"tcp://{a.host}:{a.port}")
    finally:
        if rx is not None:
            rx.close()
