"""RankGroup: the N processes of one tensor-parallel worker and the collectives between them.

Lifecycle (a worker started with `--tp N`; N == 1 is a group of one that never touches
torch.distributed):
  rank 0 = the worker's main process: `RankGroup.launch(args, role, worker_id, setup)`
      -> a TCPStore on a free loopback port, ranks 1..N-1 spawned (multiprocessing `spawn`, each
         running engine.tp.follower.follower_main), the process groups joined, a monitor thread
  every rank runs `setup(args, worker_id, group)` (model shard, KV pool, KV transfer endpoint,
      CUDA graphs), agreeing on what must match (min_int / check_same / gather_endpoints)
  rank 0 then runs the worker's loop; followers run engine.tp.follower.Follower.run
  rank 0 leaves with close(): SHUTDOWN -> each follower answers Bye and exits -> join (kill after
      a deadline)

Process groups:
  model    WORLD: gloo on CPU, NCCL on GPU (rank r on cuda:base+r, NCCL_NVLS_ENABLE=0): the
           layers' all-reduces, timeout max(10 min, --tp-timeout-s) (ranks may skew while one JITs)
  command  gloo, no practical timeout: rank 0 broadcasts each command; an idle follower waits in it
  reply    gloo, --tp-timeout-s: every rank's answer, all-gathered
Payloads are typed messages (engine.tp.messages) in a fixed-size uint8 buffer (length + body),
with a second collective only for the rare message that does not fit.

Failures: a follower that dies makes rank 0's next collective fail (gloo notices a closed peer at
once) and rank 0 raises WorkerUnavailable naming the rank and its exit code. The monitor thread
covers what a collective cannot: an idle rank 0, or one stuck in an NCCL collective, is ended
`exit_grace_s` after a follower exited, with that message. Followers watch rank 0 the same way
(its death breaks their command wait; a parent-pid watchdog backs it up).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from common.errors import ConfigError, WorkerUnavailable
from engine.tp import messages as msgs

log = logging.getLogger("tandem.tp")

CAPACITY = 32 << 10  # bytes per message buffer; a decode STEP of ~300 sequences fits
FOREVER = timedelta(days=3650)
MODEL_TIMEOUT_S = 600.0
RANK_LOST_EXIT = 75  # EX_TEMPFAIL: the supervisor should restart the worker


def rank_device(device: str, rank: int) -> str:
    """`cuda` / `cuda:k` -> the device of TP rank r (cuda:k+r); CPU ranks share the CPU."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


class RankGroup:
    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.procs: list[Any] = []  # rank 0: the followers' multiprocessing.Process, rank r at r-1
        self.model_group = None  # ParallelConfig.group
        self._cmd = self._reply = self._store = None
        self._closing = threading.Event()
        self._serving = self._broken = False
        self.local_bye: Callable[[], msgs.Bye] = lambda: msgs.Bye(0, 0, 0)  # rank 0's own state, for close()

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def launch(cls, a: argparse.Namespace, role: str, worker_id: str,
               setup: Callable[[argparse.Namespace, str, RankGroup], Any],
               target: Callable[[Any], None] | None = None) -> RankGroup:
        """Rank 0: spawn the followers and join the process groups (a group of one for --tp 1).
        `target` is the followers' entry point (default engine.tp.follower.follower_main; tests
        pass a stand-in), called with a FollowerSpec."""
        if a.tp < 1:
            raise ConfigError("--tp must be >= 1")
        group = cls(0, a.tp, a.tp_timeout_s)
        if a.tp == 1:
            return group
        if a.kv_backend == "loopback":
            raise ConfigError("--tp > 1 needs --kv-backend nixl (or none): loopback is in-process only")
        if a.device.startswith("cuda"):
            need = int(rank_device(a.device, a.tp - 1).split(":")[1]) + 1
            if torch.cuda.device_count() < need:
                raise ConfigError(f"--tp {a.tp} on {a.device} needs {need} GPUs, {torch.cuda.device_count()} visible")
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (inherited by followers)
        store = dist.TCPStore("127.0.0.1", 0, a.tp, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=max(300.0, a.tp_timeout_s)))
        from engine.tp.follower import FollowerSpec, follower_main

        ctx = mp.get_context("spawn")
        group._store = store  # keep the rendezvous alive while the others connect
        try:
            for r in range(1, a.tp):
                spec = FollowerSpec(r, a.tp, store.port, a, role, worker_id, setup, os.getpid())
                p = ctx.Process(target=target or follower_main, args=(spec,), name=f"{role}-tp{r}", daemon=True)
                p.start()
                log.info("tensor-parallel rank %d started (pid %d)", r, p.pid)
                group.procs.append(p)
            threading.Thread(target=group._monitor, name="tp-monitor", daemon=True).start()
            group._init(a.device, store)
        except BaseException as e:
            err = group.failure(e) if isinstance(e, RuntimeError) else None  # before close() kills the rest
            group.close()  # not serving yet: kills what was started
            if err is not None:
                raise err from e
            raise
        return group

    @classmethod
    def join(cls, rank: int, world: int, port: int, a: argparse.Namespace) -> RankGroup:
        """A follower: connect to rank 0's store and join the process groups."""
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=max(300.0, a.tp_timeout_s)))
        group = cls(rank, world, a.tp_timeout_s)
        group._init(a.device, store)
        return group

    def _init(self, device: str, store: Any) -> None:
        # The model group waits out rank skew (a kernel JIT-compiled on one rank first, up to a minute
        # for FlashInfer); a DEAD rank is caught at once by gloo or by the monitor, not by this timeout.
        model_timeout = timedelta(seconds=max(MODEL_TIMEOUT_S, self.timeout_s))
        if device.startswith("cuda"):
            dev = torch.device(rank_device(device, self.rank))
            torch.cuda.set_device(dev)
            dist.init_process_group("nccl", store=store, rank=self.rank, world_size=self.world,
                                    timeout=model_timeout, device_id=dev)
        else:
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world, timeout=model_timeout)
        self.model_group = dist.group.WORLD
        self._cmd = dist.new_group(backend="gloo", timeout=FOREVER)
        self._reply = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    # ---- start-up agreements (every rank, same order) ------------------------------------------------
    def min_int(self, value: int) -> int:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._cmd))
        return int(t.item())

    def check_same(self, what: str, values: list[int]) -> None:
        """Raise ConfigError unless every rank has the same `values` (page ids, pool sizes...)."""
        got = [m.values for m in self._collective(lambda: self._gather(msgs.Agree(what, list(values)), self._cmd,
                                                                        msgs.Agree))]
        if any(g != got[0] for g in got):
            raise ConfigError(f"tensor-parallel ranks disagree on {what}: {got}")

    def gather_endpoints(self, endpoint: str, epoch: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Every decode rank's KV side channel and epoch, in rank order (for set_rank_endpoints)."""
        got = self._collective(lambda: self._gather(msgs.Endpoint(endpoint, epoch), self._cmd, msgs.Endpoint))
        return tuple(m.endpoint for m in got), tuple(m.epoch for m in got)

    # ---- commands ------------------------------------------------------------------------------------
    def serving(self) -> None:
        """Rank 0 finished set-up; from now on close() stops the followers with SHUTDOWN."""
        self._serving = True

    def command(self, cmd: msgs.CommandMsg) -> None:
        """Rank 0: broadcast a command that has no answer (STEP)."""
        assert self.rank == 0
        self._collective(lambda: self._broadcast(msgs.encode(cmd)))

    def call(self, cmd: msgs.CommandMsg, local: Callable[[], Any]) -> list[Any]:
        """Rank 0: broadcast `cmd`, run `local()` (rank 0's share, the followers' handler code),
        all-gather every rank's answer (rank order)."""
        assert self.rank == 0
        self._collective(lambda: self._broadcast(msgs.encode(cmd)))
        own = local()
        return self._collective(lambda: self._gather(own, self._reply))

    def next_command(self, idle: Callable[[], None], idle_every_s: float = 0.005) -> msgs.CommandMsg:
        """Follower: wait for rank 0's next command, calling `idle()` every `idle_every_s` meanwhile.
        Raises RuntimeError when rank 0 is gone."""
        head = torch.zeros(CAPACITY, dtype=torch.uint8)
        work = dist.broadcast(head, 0, group=self._cmd, async_op=True)
        t0 = last_idle = time.monotonic()
        while not work.is_completed():
            now = time.monotonic()
            if now - last_idle >= idle_every_s:
                idle()
                last_idle = time.monotonic()
            waited = now - t0  # commands come in bursts: poll fast right after one, back off when idle
            time.sleep(5e-5 if waited < 0.002 else 5e-4 if waited < 0.1 else 2e-3)
        work.wait()
        return msgs.decode(self._rest(head, self._cmd))

    def broadcast_inputs(self, ids: torch.Tensor) -> None:
        """A step's [T] input ids from rank 0 to every rank, on the device (stream-ordered on GPUs: no
        host sync, so rank 0's overlapped loop keeps its tokens on the GPU)."""
        dist.broadcast(ids, 0, group=self.model_group)

    def reply(self, answer: Any) -> None:
        """Follower: this rank's answer to the current command."""
        self._gather(answer, self._reply)

    # ---- failures ------------------------------------------------------------------------------------
    def lost(self, wait_s: float = 0.0) -> WorkerUnavailable | None:
        """A follower that exited, as the error rank 0 raises (waits up to wait_s for one)."""
        end = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    return WorkerUnavailable(f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                                             "this worker cannot serve and stops (its supervisor restarts it)")
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def failure(self, err: BaseException) -> WorkerUnavailable:
        return self.lost(wait_s=2.0) or WorkerUnavailable(f"tensor-parallel group failed: {err}")

    def _collective(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as e:  # DistBackendError included: a peer died or timed out
            self._broken = True
            if self.rank != 0:
                raise
            raise self.failure(e) from e

    def _monitor(self, exit_grace_s: float = 3.0) -> None:
        """Rank 0: end the process when a follower exits and the main thread did not (idle, or
        stuck in a collective that cannot notice, like NCCL)."""
        mp.connection.wait([p.sentinel for p in self.procs])
        if self._closing.is_set():
            return
        err = self.lost(wait_s=1.0)  # the sentinel may fire just before the exit code can be read
        log.error("%s", err.message if err else "a tensor-parallel rank exited")
        if self._closing.wait(exit_grace_s):
            return
        log.error("ending the worker now (exit code %d)", RANK_LOST_EXIT)
        os._exit(RANK_LOST_EXIT)

    # ---- byte collectives ----------------------------------------------------------------------------
    def _broadcast(self, data: bytes) -> None:
        head = _pack(data)
        dist.broadcast(head, 0, group=self._cmd)
        if len(data) > CAPACITY - 8:
            dist.broadcast(torch.frombuffer(bytearray(data[CAPACITY - 8:]), dtype=torch.uint8), 0, group=self._cmd)

    def _rest(self, head: torch.Tensor, group: Any) -> bytes:
        n = int.from_bytes(head[:8].numpy().tobytes(), "little")
        body = head[8:8 + min(n, CAPACITY - 8)].numpy().tobytes()
        if n > CAPACITY - 8:
            rest = torch.empty(n - (CAPACITY - 8), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=group)
            body += rest.numpy().tobytes()
        return body

    def _gather(self, msg: Any, group: Any, *expected: type) -> list[Any]:
        if self.world == 1:
            return [msg]
        data = msgs.encode(msg)
        heads = [torch.empty(CAPACITY, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(heads, _pack(data), group=group)
        sizes = [int.from_bytes(h[:8].numpy().tobytes(), "little") for h in heads]
        bodies = [h[8:8 + min(n, CAPACITY - 8)].numpy().tobytes() for h, n in zip(heads, sizes)]
        over = max(n - (CAPACITY - 8) for n in sizes)
        if over > 0:
            tail, mine = torch.zeros(over, dtype=torch.uint8), data[CAPACITY - 8:]
            if mine:
                tail[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            tails = [torch.empty(over, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(tails, tail, group=group)
            bodies = [b + t[:max(0, n - (CAPACITY - 8))].numpy().tobytes() for b, t, n in zip(bodies, tails, sizes)]
        return [msgs.decode(b, *expected) for b in bodies]

    # ---- shutdown ------------------------------------------------------------------------------------
    def close(self, deadline_s: float = 10.0) -> None:
        """Rank 0: stop the followers (SHUTDOWN, each answers Bye: logged, the leak check of every
        rank's transfer state), then the process groups. A broken group is terminated instead."""
        if self.world == 1 or self._closing.is_set():
            return
        self._closing.set()
        graceful = self._serving and not self._broken and self.lost() is None
        if graceful:
            try:
                for r, bye in enumerate(self.call(msgs.Shutdown(), self.local_bye)):
                    log.info("tensor-parallel rank %d stopped: %d open receives, %d open sends, %d quarantined "
                             "pages", r, bye.open_receives, bye.open_sends, bye.quarantined_pages)
            except WorkerUnavailable as e:
                log.warning("stopping the followers: %s", e.message)
                graceful = False
        end = time.monotonic() + deadline_s
        for p in self.procs:  # followers ignore SIGTERM (rank 0 drains for them): a broken group is killed
            if not graceful and p.exitcode is None:
                p.kill()
            p.join(max(0.1, end - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        if graceful:
            dist.destroy_process_group()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pack(data: bytes) -> torch.Tensor:
    head = torch.zeros(CAPACITY, dtype=torch.uint8)
    head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
    k = min(len(data), CAPACITY - 8)
    if k:
        head[8:8 + k] = torch.frombuffer(bytearray(data[:k]), dtype=torch.uint8)
    return head
