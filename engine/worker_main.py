"""What both worker entry points share: build the engine parts, the KV transfer endpoint, the
network thread and the health server, then run the role's loop until it drains."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import NoReturn

from common.gc_pauses import freeze_startup_heap, process_pauses
from common.http_health import HealthServer
from engine.worker_args import engine_config
from common.worker_io import WorkerIO
from engine.build import EngineParts, build_engine_parts, kv_budget, load_model
from engine.build import model_fingerprint as build_fingerprint
from engine.tp.group import RankGroup
from kv_transfer.interface import TransferConfig

log = logging.getLogger("tandem.worker")


def model_fingerprint(parts: EngineParts) -> str:
    """Names the model in the KV compatibility check: same config, same KV meaning."""
    return build_fingerprint(parts.model)


def build_parts(a: argparse.Namespace, role: str, group: RankGroup) -> EngineParts:
    """This rank's shard of the model and its KV pool. Every TP rank's pool must hold the same page
    ids (rank 0 allocates for all), so the ranks agree on the smallest KV budget."""
    cfg = engine_config(a, role=role, tp_rank=group.rank, group=group.model_group)
    import torch

    if cfg.device == "cpu":
        torch.set_num_threads(a.cpu_threads)
    else:  # graphs, streams and libraries use the current device
        torch.cuda.set_device(torch.device(cfg.device))
    model = load_model(cfg)
    parts = build_engine_parts(dataclasses.replace(cfg, kv_cache_bytes=group.min_int(kv_budget(cfg))), model)
    group.check_same("KV pages per page group", list(parts.spec.num_pages))
    if group.rank == 0:  # the sampling rank: the grammar tokenizer is built now, not in a request's step
        import time

        from common.grammar import GRAMMAR_LIBRARY, default_compiler

        from common.errors import InvalidRequest

        t0 = time.monotonic()
        try:
            default_compiler().tokenizer  # noqa: B018
            log.info("structured outputs: %s tokenizer for o200k_harmony built in %.2f s", GRAMMAR_LIBRARY,
                     time.monotonic() - t0)
        except InvalidRequest as e:  # the library is missing: requests with a response_format get a 400
            log.warning("structured outputs unavailable: %s", e.message)
    if cfg.attention_backend != "torch":
        from engine.selftest import self_test_attention

        be = parts.model.backends
        self_test_attention(be.attention, cfg.device, parts.model.dtype, kv_dtype=parts.spec.dtype,
                            rope=be.fused_rope_store)
        log.info("attention self-test passed (%s, KV %s)", cfg.attention_backend, parts.spec.dtype)
    return parts


def maybe_warm_up(a: argparse.Namespace, parts: EngineParts) -> None:
    """engine/warmup.py on rank 0's parts (a TP group's followers run the same steps), before ready."""
    if a.warmup == "on" or (a.warmup == "auto" and not a.device.startswith("cpu")):
        from engine.warmup import warm_up

        warm_up(parts, a.seed)


def transfer_config(a: argparse.Namespace, parts: EngineParts, wid: str, tp_rank: int = 0) -> TransferConfig:
    return TransferConfig(engine_id=wid, model_name=model_fingerprint(parts), tp_rank=tp_rank, tp_size=a.tp,
                          host=a.advertise_host or a.host, port=a.kv_port + tp_rank if a.kv_port else 0)


def exit_now(code: int) -> NoReturn:
    """End a worker process whose own clean-up is done (sockets closed, NIXL memory deregistered, TP
    followers stopped). The interpreter's teardown would free every tensor one by one (the KV pool,
    the weights; each munmap through UCX's memory hooks) and took seconds on a loaded host, past the
    drain deadline a supervisor grants; the OS reclaims all of it at once."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(a: argparse.Namespace, server, io_bind: str) -> int:
    io = WorkerIO(io_bind, server.status)
    server.io = io
    io.start()
    health = HealthServer(a.host, a.metrics_port, server.ready_check) if a.metrics_port else None
    if health:
        health.start()
    server.install_signals()
    # Start-up is done (weights, graphs, warm-up): its ~200k objects leave the collector's walks, and
    # every pause is timed (common/gc_pauses.py; tandem_gc_pause_seconds on /metrics).
    freeze_startup_heap(server.worker_id)
    process_pauses()  # after the freeze's own full collection, which is start-up's
    log.info("%s ready on %s (metrics :%s)", server.worker_id, io_bind, health.port if health else "off")
    try:
        server.run()
    finally:
        io.close()
        if health:
            health.close()
    return 0
