"""A follower rank (1..N-1) of a tensor-parallel worker: the same setup as rank 0, then one loop.

    follower_main(spec):  join the process groups -> setup(args, worker_id, group) -> Follower.run
    Follower.run():
        while True:
            command = wait for rank 0's next one (keeping this rank's KV transfers moving meanwhile)
            STEP      -> rebuild the batch from the page mirror; the same forward as rank 0 (its
                         all-reduces are the synchronisation), with this rank's KV sender attached
                         when rank 0's has one; input ids sampled by rank 0's step in flight come
                         by a device broadcast; no sampling, no answer
            SHUTDOWN  -> answer Bye (this rank's leftover transfer state), close, exit
            KV        -> LocalKV.handle, the same code rank 0 runs for its share; answer
A follower never decides anything: no scheduling, no page allocation, no sampling. When rank 0
goes away the command wait fails (or the parent-pid watchdog fires) and the follower exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.gc_pauses import freeze_startup_heap
from engine import prompt_logprobs
from engine.tp import messages as m
from engine.tp.group import RANK_LOST_EXIT, RankGroup
from engine.tp.local_kv import LocalKV
from engine.tp.proxies import RankParts
from engine.tp.step import StepMirror
from engine.worker_main import exit_now

log = logging.getLogger("tandem.tp")


@dataclass(frozen=True)
class FollowerSpec:
    """Everything a spawned follower needs (pickled by multiprocessing `spawn`)."""

    rank: int
    world: int
    store_port: int
    args: argparse.Namespace
    role: str
    worker_id: str
    setup: Callable[[argparse.Namespace, str, RankGroup], RankParts]
    parent_pid: int


class Follower:
    def __init__(self, group: RankGroup, rp: RankParts) -> None:
        self.group, self.runner = group, rp.parts.runner
        self.kv = LocalKV(rp.sender, rp.receiver)
        self.mirror = StepMirror()

    def run(self) -> None:
        while True:
            cmd = self.group.next_command(idle=self.kv.idle)
            match cmd:
                case m.Step():
                    ids, steps, rows = self.mirror.apply(cmd)
                    if cmd.ids_on_device:  # rank 0's overlapped loop: the ids come as a device broadcast
                        t = torch.empty(len(ids), dtype=torch.long, device=self.runner.device)  # [T]
                        self.group.broadcast_inputs(t)
                        ids = t
                    on_layer_done = self.kv.tx.layer_done if cmd.layer_done else None
                    self.runner.forward(ids, steps, rows, on_layer_done, want_logits=False,
                                        prompt_rows=prompt_logprobs.shares(cmd.prompt_rows, self.runner.model.par))
                case m.Shutdown():
                    self.group.reply(self.kv.bye())
                    return
                case _:
                    self.group.reply(self.kv.handle(cmd))

    def close(self) -> None:
        for endpoint in (self.kv.tx, self.kv.rx):
            if endpoint is not None:
                endpoint.close()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    log.error("rank 0 (pid %d) is gone; exiting", parent_pid)
    os._exit(RANK_LOST_EXIT)


def follower_main(spec: FollowerSpec) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [tp{spec.rank}]: %(message)s")
    # Rank 0 alone answers signals (drain on SIGTERM, Ctrl-C to the process group included) and
    # stops its followers with SHUTDOWN once drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), name="parent-watch", daemon=True).start()
    group = RankGroup.join(spec.rank, spec.world, spec.store_port, spec.args)
    follower = Follower(group, spec.setup(spec.args, spec.worker_id, group))
    freeze_startup_heap(f"{spec.role} tp{spec.rank}")  # a pause here stalls every rank's collective
    log.info("%s tensor-parallel rank %d/%d ready", spec.role, spec.rank, spec.world)
    try:
        follower.run()
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        log.error("leaving the group: %s", e)
        os._exit(RANK_LOST_EXIT)
    follower.close()
    torch.distributed.destroy_process_group()
    exit_now(0)  # as rank 0 does: the interpreter's tensor-by-tensor teardown would outlast the drain
