"""`tandem decode-worker`: flags -> (every TP rank) engine parts + KV receiver + CUDA graphs ->
rank 0 runs the DecodeServer loop; with --tp N, ranks 1..N-1 follow it (engine.tp)."""

from __future__ import annotations

import argparse

from engine.worker_args import add_worker_args, cuda_graphs_on, worker_id
from engine.worker_main import build_parts, exit_now, maybe_warm_up, serve, transfer_config
from decode_worker.engine import DecodeEngine
from decode_worker.server import DecodeServer
from engine.core import EngineCore
from engine.launch_hold import LaunchHold
from engine.tp.group import RankGroup
from engine.tp.proxies import RankParts, lead
from kv_transfer.interface import new_epoch


def setup_rank(a: argparse.Namespace, wid: str, group: RankGroup) -> RankParts:
    """Runs on every TP rank, in the same order (the agreements are collectives)."""
    parts = build_parts(a, "decode", group)
    rx = None
    if a.kv_backend != "none":
        from kv_transfer.factory import TransferBackend, create_receiver

        rx = create_receiver(TransferBackend(a.kv_backend), parts.pool, transfer_config(a, parts, wid, group.rank))
        rx.set_rank_endpoints(*group.gather_endpoints(rx.endpoint, rx.epoch))
    if cuda_graphs_on(a):
        from engine.decode_graphs import CudaGraphDecoder

        # Each rank captures its own graphs (their all-reduces included); replays stay in lockstep
        # because every rank runs the same steps. Padding pages must be the same ids everywhere.
        graphs = CudaGraphDecoder(parts.model, parts.pool, parts.kv, a.max_num_seqs, a.max_model_len)
        group.check_same("CUDA-graph padding pages", graphs.dummy.full + graphs.dummy.ring)
        graphs.capture()
        parts.runner.graphs = graphs
    return RankParts(parts, receiver=rx)


def tune_loop(core: EngineCore, a: argparse.Namespace) -> None:
    """The step loop's flags (engine/core.py): --collect-order, --first-token-wait-ms, --launch-hold."""
    core.collect_ready = core.collect_ready and a.collect_order != "launch"
    core.first_token_wait_s = max(a.first_token_wait_ms, 0.0) / 1e3
    if a.launch_hold and core.overlap and a.device.startswith("cuda"):  # CPU steps have no GPU clock
        core.launch_hold = LaunchHold(bubble_frac=max(a.launch_hold_bubble, 0.0))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem decode-worker", description="continuous-batching decode worker")
    add_worker_args(p, port=7200, metrics_port=9200)
    a = p.parse_args(argv)
    wid, epoch = worker_id(a, "decode"), new_epoch()
    with RankGroup.launch(a, "decode", wid, setup_rank) as group:
        rp = lead(group, setup_rank(a, wid, group))
        maybe_warm_up(a, rp.parts)
        engine = DecodeEngine(rp.parts, rp.receiver, overlap=a.async_decode == "on")
        tune_loop(engine.core, a)
        if a.step_trace:
            from engine.step_trace import StepTrace

            engine.core.trace = StepTrace(a.step_trace)
            rp.parts.runner.time_gpu = True  # each step's GPU span in the trace
        server = DecodeServer(engine, None, wid, epoch, a.drain_timeout_s)
        try:
            code = serve(a, server, f"tcp://{a.host}:{a.port}")
        finally:
            if rp.receiver is not None:
                rp.receiver.close()
            if engine.core.trace is not None:
                engine.core.trace.close()
    exit_now(code)
