"""One request's path through the fleet: wait for a placement (router.admission) -> admit on decode
-> prefill (KV pushed into the reserved pages) -> start decode -> stream tokens. Colocated: wait for
a placement -> generate on decode.

Prefix caching: placement sees each worker's cached prefix of the prompt (router/prefix_index.py);
decode's admission answers with the prefix it holds (only the rest is shipped), the prefill worker
with what it took from its own cache; a short uncached suffix on a decode worker that holds the
prefix is prefilled there (router/prefill_cost.py). Each request's `PrefixStats` feed the response's
usage (prompt_tokens_details.cached_tokens) and the router's metrics; when it ends, the router
records what its workers are about to cache (provisional index entries).

    async for chunk in orchestrator.generate(job): ...

Failures before the first token (a worker down, a failed transfer) are retried transparently on
other workers, up to `max_attempts`; after that the caller gets a typed error (503 with a reason).
A decode worker that answers Rejected (no room after all: another router's burst, KV grown since
the poll) costs no attempt: the request re-enters the admission queue at its place. Once tokens
have been streamed, a failure ends the stream with an error. Every wait has a deadline.

One cancellation path: the caller stops iterating or its task is cancelled (client gone, request
timeout, drain deadline) wherever the request is (queued, waiting for prefill, streaming); the
`finally` of `_attempt` then sends Abort to the decode worker (and `_prefill` to the prefill
worker), which frees the request's pages at its next step, and the placement is released so the
queue can place the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import AdmissionRejected, TandemError, TransferFailed, WorkerUnavailable
from router.config import RouterConfig
from router.fleet import Fleet
from router.metrics import RouterMetrics
from router.admission import AdmissionQueue, Ticket
from router.placement import Placement
from router.prefix_index import PromptHashes
from wire.protocol import (
    Abort,
    AdmitRequest,
    Admitted,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Rejected,
    SamplingSpec,
    StartDecode,
    TokenChunk,
)

log = logging.getLogger("tandem.router")


MAX_REQUEUES = 64  # Rejected races in a row before the request gives up (each waits for a poll)


@dataclass(slots=True)
class Trace:
    """What the HTTP layer reports about one request's path (queue wait header, TTFT after admission)."""

    queue_wait_s: float = 0.0
    placed_at: float | None = None  # monotonic time of the last placement
    worker_s: float = 0.0  # the attempt that streamed: its send to the workers -> first token back
    parts: dict[str, float] = field(default_factory=dict)  # its TTFT breakdown (router/metrics.py components)
    decode: str = ""  # the workers of the last placement ("" prefill: on the decode worker)
    prefill: str = ""
    # The first token was handed to the HTTP writer (a stream's first body bytes; non-streamed: from the
    # start): until then the worker client holds back the step's other tokens (router/worker_client.py).
    first_out: bool = False


@dataclass(slots=True)
class PrefixStats:
    """What prefix caching did for one request (the attempt that produced its tokens)."""

    prefill: str = ""  # "remote" (a prefill worker) | "local" (on the decode worker)
    cached_tokens: int = 0  # prompt tokens the computing worker took from its cache (not recomputed)
    computed_tokens: int = 0  # prompt tokens prefilled
    decode_cached_tokens: int = 0  # remote: the prefix decode already held (not shipped)
    kv_bytes: int = 0  # KV bytes shipped prefill -> decode


@dataclass(frozen=True, slots=True)
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    priority: int = 0  # lower runs sooner (vLLM's convention)
    trace: Trace = field(default_factory=Trace, compare=False)
    stats: PrefixStats = field(default_factory=PrefixStats, compare=False)
    hashes: PromptHashes | None = field(default=None, compare=False)  # block hashes per cache identity, on first use


class _Requeue(Exception):
    """The decode worker refused for lack of room: wait in the queue again (no attempt used)."""


class Orchestrator:
    def __init__(self, fleet: Fleet, cfg: RouterConfig, metrics: RouterMetrics, admission: AdmissionQueue) -> None:
        self.fleet, self.cfg, self.metrics, self.admission = fleet, cfg, metrics, admission
        self._tasks: set[asyncio.Task] = set()  # fire-and-forget aborts, kept alive until sent

    async def generate(self, job: Job) -> AsyncIterator[TokenChunk]:
        exclude: set[str] = set()
        last: TandemError | None = None
        hashes = job.hashes or PromptHashes(job.prompt_ids)
        # prompt logprobs: the computing worker skips its prefix cache, so placement must not count on a hit
        ticket = Ticket(job.request_id, len(job.prompt_ids), job.sampling.max_tokens, job.priority,
                        hashes=hashes if job.sampling.prompt_logprobs is None else None)
        attempt = requeues = 0
        while attempt < self.cfg.max_attempts:
            rid = job.request_id if attempt == 0 else f"{job.request_id}.r{attempt}"
            ticket.request_id, ticket.exclude = rid, frozenset(exclude)
            p = await self.admission.admit(ticket)
            job.trace.queue_wait_s, job.trace.placed_at = ticket.waited_s, time.monotonic()
            job.trace.decode, job.trace.prefill = p.decode, p.prefill or ""
            streamed, backoff_s = False, 0.0
            try:
                async for chunk in self._attempt(Job(rid, job.prompt_ids, job.sampling, trace=job.trace,
                                                     stats=job.stats, hashes=hashes), p, exclude):
                    streamed = True
                    yield chunk
                return
            except _Requeue:
                requeues += 1
                if requeues > MAX_REQUEUES:
                    raise AdmissionRejected(f"decode workers refused this request {requeues} times") from None
            except (WorkerUnavailable, AdmissionRejected, TransferFailed) as e:
                if streamed:
                    raise
                last = e
                log.warning("request %s attempt %d failed before its first token: %s", job.request_id, attempt, e.message)
                self.metrics.retries.inc()
                attempt += 1
                backoff_s = min(0.05 * 2 ** attempt, 1.0)
            finally:
                self.admission.release(p, rid)
            if backoff_s:
                await asyncio.sleep(backoff_s)
        assert last is not None
        raise last

    async def _attempt(self, job: Job, p: Placement, exclude: set[str]) -> AsyncIterator[TokenChunk]:
        n = len(job.prompt_ids)
        assert job.hashes is not None
        decode = self.fleet.client(p.decode)
        rid = job.request_id
        stream = decode.open_stream(rid, out=job.trace)  # the stall deadline starts once decode is asked
        finished = False
        output: list[int] = []
        try:
            t_sent = time.monotonic()
            if p.prefill is None:
                job.stats.prefill = "local"
                decode.arm_stream(rid, self.cfg.stream_timeout_s)
                await decode.send(GenerateRequest(rid, job.prompt_ids, job.sampling))
            else:
                first = await self._prefill(job, p.decode, p.prefill, exclude)
                decode.arm_stream(rid, self.cfg.stream_timeout_s)
                await decode.send(StartDecode(rid, job.prompt_ids, job.sampling, first.first_token,
                                              first.first_logprob, first.first_top))
                output.append(first.first_token)
                if job.sampling.share_prompt:  # n > 1: decode indexes the landed prompt (model/prefix_share.py)
                    self.fleet.predict(p.decode, job.hashes, job.prompt_ids, len(job.prompt_ids))
                job.trace.worker_s = time.monotonic() - t_sent
                yield TokenChunk(rid, [first.first_token], [first.first_logprob] if first.first_logprob is not None else [],
                                 [first.first_top] if job.sampling.logprobs is not None else [], False, "", "",
                                 first.cached_tokens, prompt=first.prompt)
            while not finished:
                item = await stream.get()  # the client's stall watchdog bounds the wait (stream_timeout_s)
                if isinstance(item, Exception):
                    exclude.add(p.decode)
                    raise item
                if item.error:
                    raise TransferFailed(item.error) if "transfer" in item.error else WorkerUnavailable(item.error)
                finished = item.finished
                if p.prefill is None and not output:
                    self._count(job, "decode", item.cached_tokens)
                    job.trace.worker_s = time.monotonic() - t_sent
                    job.trace.parts = self.metrics.observe_local_ttft_parts(item.queue_seconds, item.prefill_seconds,
                                                                            job.trace.worker_s)
                if not output and job.sampling.share_prompt:  # n > 1: the prompt is cached on decode now
                    self.fleet.predict(p.decode, job.hashes, job.prompt_ids, len(job.prompt_ids))
                output += item.token_ids
                yield item
        finally:
            if finished:  # the decode worker caches prompt + output (all but the last token's KV)
                self.fleet.predict(p.decode, job.hashes, job.prompt_ids + output, n + len(output) - 1)
            decode.close_stream(rid)
            if not finished:  # failure, cancellation or client gone: free the request's pages on the worker
                self._spawn(self._abort(decode, rid, "router abort"))

    async def _prefill(self, job: Job, decode_addr: str, prefill_addr: str, exclude: set[str]) -> PrefillResult:
        decode, prefill = self.fleet.client(decode_addr), self.fleet.client(prefill_addr)
        prefill_tp = 1  # a prefill worker advertises its TP through the transfer handshake
        rid = job.request_id
        t0 = time.monotonic()
        try:
            reply = await decode.call(AdmitRequest(rid, len(job.prompt_ids), job.sampling.max_tokens, prefill_tp,
                                                   self.cfg.reservation_s, job.prompt_ids),
                                      rid, self.cfg.rpc_timeout_s)
        except WorkerUnavailable:
            exclude.add(decode_addr)
            raise
        if isinstance(reply, Rejected):
            if reply.retryable:  # no room after all: shown full until its next poll, back into the queue
                self.fleet.mark_full(decode_addr)
                raise _Requeue(reply.reason)
            exclude.add(decode_addr)
            raise AdmissionRejected(f"decode worker {decode_addr} refused: {reply.reason}")
        assert isinstance(reply, Admitted)
        t_admitted = time.monotonic()
        try:
            res = await prefill.call(PrefillRequest(rid, job.prompt_ids, job.sampling, reply.kv_target,
                                                    self.cfg.transfer_deadline_s), rid, self.cfg.prefill_timeout_s)
        except WorkerUnavailable:
            exclude.add(prefill_addr)
            await self._abort(prefill, rid, "prefill timed out")
            raise
        except asyncio.CancelledError:  # client gone / timeout / drain while queued or computing on prefill
            self._spawn(self._abort(prefill, rid, "cancelled"))
            raise
        finally:
            self.admission.prefill_done(prefill_addr, rid)
        assert isinstance(res, PrefillResult)
        if not res.ok:
            exclude.add(prefill_addr)
            raise TransferFailed(f"prefill on {prefill_addr} failed: {res.error}")
        self.metrics.observe_prefill(res.prefill_seconds, res.transfer_bytes, res.transfer_seconds,
                                     time.monotonic() - t0)
        job.stats.prefill, job.stats.decode_cached_tokens, job.stats.kv_bytes = "remote", reply.cached_tokens, \
            res.transfer_bytes
        self._count(job, "prefill", res.cached_tokens)
        self.metrics.prefix_decode_cached.inc(reply.cached_tokens)
        assert job.hashes is not None
        self.fleet.predict(prefill_addr, job.hashes, job.prompt_ids, len(job.prompt_ids))
        job.trace.parts = self.metrics.observe_ttft_parts(t_admitted - t0, res.queue_seconds, res.prefill_seconds,
                                                          res.tail_seconds, time.monotonic() - t_admitted)
        if res.split is not None:
            job.trace.parts |= self.metrics.observe_compute_split(res.prefill_seconds, res.split)
        return res

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, timeout_s: float) -> None:
        """Wait (bounded) until every Abort has been sent: used before the router exits."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def _count(self, job: Job, role: str, cached: int) -> None:
        n = len(job.prompt_ids)
        job.stats.cached_tokens, job.stats.computed_tokens = cached, n - cached
        self.metrics.observe_prefix(role, n, cached, job.stats.kv_bytes)

    async def _abort(self, client, rid: str, reason: str) -> None:
        try:
            await client.send(Abort(rid, reason))
        except Exception as e:  # noqa: BLE001 - best effort: the worker's own deadline frees pages too
            log.debug("abort of %s on %s failed: %s", rid, client.address, e)
