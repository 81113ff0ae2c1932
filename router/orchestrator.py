"""One request's path through the fleet: place -> admit on decode -> prefill (KV pushed into the
reserved pages) -> start decode -> stream tokens. Colocated: place -> generate on decode.

    async for chunk in orchestrator.generate(job): ...

Failures before the first token (a worker down, a rejected admission, a failed transfer) are
retried transparently on other workers, up to `max_attempts`; after that the caller gets a typed
error (503 with a reason). Once tokens have been streamed, a failure ends the stream with an error.
Every wait has a deadline. Leaving early (client disconnect) aborts the request on its workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.errors import AdmissionRejected, TandemError, TransferFailed, WorkerUnavailable
from router.config import RouterConfig
from router.fleet import Fleet
from router.metrics import RouterMetrics
from router.placement import place
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


@dataclass(frozen=True, slots=True)
class Job:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSpec


class Orchestrator:
    def __init__(self, fleet: Fleet, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.fleet, self.cfg, self.metrics = fleet, cfg, metrics

    async def generate(self, job: Job) -> AsyncIterator[TokenChunk]:
        exclude: set[str] = set()
        last: TandemError | None = None
        for attempt in range(self.cfg.max_attempts):
            rid = job.request_id if attempt == 0 else f"{job.request_id}.r{attempt}"
            streamed = False
            try:
                async for chunk in self._attempt(Job(rid, job.prompt_ids, job.sampling), exclude):
                    streamed = True
                    yield chunk
                return
            except (WorkerUnavailable, AdmissionRejected, TransferFailed) as e:
                if streamed:
                    raise
                last = e
                log.warning("request %s attempt %d failed before its first token: %s", job.request_id, attempt, e.message)
                self.metrics.retries.inc()
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
        assert last is not None
        raise last

    async def _attempt(self, job: Job, exclude: set[str]) -> AsyncIterator[TokenChunk]:
        p = place(len(job.prompt_ids), job.sampling.max_tokens, self.fleet.snapshot(), frozenset(exclude),
                  colocated=self.cfg.colocated)
        decode = self.fleet.client(p.decode)
        rid = job.request_id
        stream = decode.open_stream(rid)
        finished = False
        try:
            if p.prefill is None:
                await decode.send(GenerateRequest(rid, job.prompt_ids, job.sampling))
            else:
                first = await self._prefill(job, p.decode, p.prefill, exclude)
                await decode.send(StartDecode(rid, job.prompt_ids, job.sampling, first.first_token,
                                              first.first_logprob, first.first_top))
                yield TokenChunk(rid, [first.first_token], [first.first_logprob] if first.first_logprob is not None else [],
                                 [first.first_top] if job.sampling.logprobs is not None else [], False, "", "")
            while not finished:
                try:
                    item = await asyncio.wait_for(stream.get(), self.cfg.stream_timeout_s)
                except asyncio.TimeoutError:
                    raise WorkerUnavailable(f"decode worker {p.decode} sent nothing for "
                                            f"{self.cfg.stream_timeout_s:.0f} s") from None
                if isinstance(item, Exception):
                    exclude.add(p.decode)
                    raise item
                if item.error:
                    raise TransferFailed(item.error) if "transfer" in item.error else WorkerUnavailable(item.error)
                finished = item.finished
                yield item
        finally:
            decode.close_stream(rid)
            if not finished:  # failure or client gone: free the request's pages on the worker
                asyncio.get_running_loop().create_task(self._abort(decode, rid, "router abort"))

    async def _prefill(self, job: Job, decode_addr: str, prefill_addr: str, exclude: set[str]) -> PrefillResult:
        decode, prefill = self.fleet.client(decode_addr), self.fleet.client(prefill_addr)
        pstate = self.fleet.state(prefill_addr)
        prefill_tp = 1  # a prefill worker advertises its TP through the transfer handshake
        rid = job.request_id
        t0 = time.monotonic()
        try:
            reply = await decode.call(AdmitRequest(rid, len(job.prompt_ids), job.sampling.max_tokens, prefill_tp,
                                                   self.cfg.transfer_deadline_s), rid, self.cfg.rpc_timeout_s)
        except WorkerUnavailable:
            exclude.add(decode_addr)
            raise
        if isinstance(reply, Rejected):
            exclude.add(decode_addr)
            raise AdmissionRejected(f"decode worker {decode_addr} refused: {reply.reason}")
        assert isinstance(reply, Admitted)
        t_admitted = time.monotonic()
        pstate.pending_tokens += len(job.prompt_ids)
        pstate.pending_requests += 1
        try:
            res = await prefill.call(PrefillRequest(rid, job.prompt_ids, job.sampling, reply.kv_target,
                                                    self.cfg.transfer_deadline_s), rid, self.cfg.prefill_timeout_s)
        except WorkerUnavailable:
            exclude.add(prefill_addr)
            await self._abort(prefill, rid, "prefill timed out")
            raise
        finally:
            pstate.pending_tokens -= len(job.prompt_ids)
            pstate.pending_requests -= 1
        assert isinstance(res, PrefillResult)
        if not res.ok:
            exclude.add(prefill_addr)
            raise TransferFailed(f"prefill on {prefill_addr} failed: {res.error}")
        self.metrics.observe_prefill(res.prefill_seconds, res.transfer_bytes, res.transfer_seconds,
                                     time.monotonic() - t0)
        self.metrics.observe_ttft_parts(t_admitted - t0, res.queue_seconds, res.prefill_seconds, res.tail_seconds,
                                        time.monotonic() - t_admitted)
        return res

    async def _abort(self, client, rid: str, reason: str) -> None:
        try:
            await client.send(Abort(rid, reason))
        except Exception as e:  # noqa: BLE001 - best effort: the worker's own deadline frees pages too
            log.debug("abort of %s on %s failed: %s", rid, client.address, e)
