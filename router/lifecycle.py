"""Every request the router serves runs in one task with one way to end it early.

    scope = inflight.open(request_id)              # arms the request timeout
    result = await scope.run(http_request, coro)   # non-streaming, or up to a stream's first token
    return StreamingResponse(scope.stream(sse, tail))  # then the stream, pumped by the same scope
    # inflight.close(scope) once the response is done (scope.stream closes itself)

Three things end a request early, all by cancelling its task, so the CancelledError passes every
`finally` on the way (admission queue: leave it; prefill: Abort; decode stream: Abort):
- the client goes away: `run` watches the ASGI receive channel for http.disconnect; a stream's
  consumer is cancelled by Starlette and cancels the pump;
- the request timeout (`--request-timeout-s`): RequestTimedOut (504);
- the drain deadline (`InFlight.cancel_all`): ServiceDraining (503).
A timed-out or drained request answers with its error (non-streaming), or ends its stream with
a finish_reason "abort" chunk, an error event and [DONE] (`tail`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from common.errors import TandemError
from router.errors import RequestTimedOut

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected: nobody is left to answer."""


class Scope:
    def __init__(self, owner: InFlight, request_id: str) -> None:
        self.owner, self.request_id = owner, request_id
        self.task: asyncio.Task | None = None
        self.error: TandemError | None = None  # why we cancelled it (None: not cancelled, or client gone)
        self.cancelled = False
        self.started = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self.on_first_out: Callable[[], None] = lambda: None  # a stream's first body bytes go to the writer

    def track_first_out(self, traces: list, stream: bool) -> None:
        """Streams: flag each trace's `first_out` when the first body bytes go to the writer (the worker
        client holds a step's other tokens until then: router/worker_client.py). Non-streamed
        requests have no first token to hurry: flagged now."""
        def mark() -> None:
            for t in traces:
                t.first_out = True
        if stream:
            self.on_first_out = mark
        else:
            mark()

    def cancel(self, error: TandemError | None) -> None:
        """End the request early; `error` is what the client is told (None: the client is gone)."""
        if self.cancelled:
            return
        self.cancelled, self.error = True, error
        if self.task is not None and not self.task.done():
            self.task.cancel()

    async def run(self, request: Request, coro: Awaitable[T]) -> T:
        """Run `coro` as this request's task; a client disconnect cancels it (raises ClientGone)."""
        self.task = asyncio.ensure_future(coro)
        if self.cancelled:  # the deadline or the drain came first
            self.task.cancel()
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({self.task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not self.task.done():  # (a done task needs no second wait: two loop iterations each time)
                self.cancel(None)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({self.task})
        except asyncio.CancelledError:  # the server itself is cancelling this handler
            self.cancel(None)
            raise
        finally:
            watcher.cancel()
        if self.task.cancelled():
            if self.error is not None:
                raise self.error
            raise ClientGone(self.request_id)
        return self.task.result()

    async def stream(self, body: AsyncIterator[bytes], tail: Callable[[TandemError], list[bytes]]
                     ) -> AsyncIterator[bytes]:
        """Pump `body` in this request's task; Starlette iterates what it produces. When the client
        goes, Starlette cancels this generator and we cancel the pump (its finally blocks abort)."""
        out: asyncio.Queue[bytes | None] = asyncio.Queue()  # bounded by the request's max_tokens

        async def pump() -> None:
            try:
                async for b in body:
                    out.put_nowait(b)
            except asyncio.CancelledError:
                if self.error is None:
                    raise
                asyncio.current_task().uncancel()  # ours (timeout / drain): answer with the tail
                await body.aclose()
                for b in tail(self.error):
                    out.put_nowait(b)
            finally:
                out.put_nowait(None)

        self.task = asyncio.ensure_future(pump())
        if self.cancelled:
            self.task.cancel()
        try:
            if (b := await out.get()) is not None:
                self.on_first_out()
                yield b
                while (b := await out.get()) is not None:
                    yield b
        finally:
            if not self.task.done():
                self.cancel(None)  # the consumer went away first: the client is gone
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({self.task}, timeout=5)
            self.owner.close(self)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class InFlight:
    """The requests this router is serving, queued or running."""

    def __init__(self, timeout_s: float, on_change: Callable[[int], None] = lambda n: None) -> None:
        self.timeout_s, self.on_change = timeout_s, on_change
        self.scopes: dict[int, Scope] = {}

    def __len__(self) -> int:
        return len(self.scopes)

    def open(self, request_id: str) -> Scope:
        s = Scope(self, request_id)
        if self.timeout_s > 0:
            s._timer = asyncio.get_running_loop().call_later(
                self.timeout_s, s.cancel,
                RequestTimedOut(f"the request ran longer than the server's request timeout ({self.timeout_s:g} s) "
                                "and was aborted"))
        self.scopes[id(s)] = s
        self.on_change(len(self.scopes))
        return s

    def close(self, s: Scope) -> None:
        if s._timer is not None:
            s._timer.cancel()
        if self.scopes.pop(id(s), None) is not None:
            self.on_change(len(self.scopes))

    def cancel_all(self, error: TandemError) -> int:
        scopes = list(self.scopes.values())
        for s in scopes:
            s.cancel(error)
        return len(scopes)
