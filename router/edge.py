"""The router's HTTP edge, as plain ASGI middleware in front of FastAPI: checks that run before a
request body is parsed.

- BodyLimit: a body over `max_bytes` gets 413 (OpenAI error body) before anything parses it: at
  once from Content-Length, or while a chunked body streams in. The rest of an oversized body is
  read and dropped (up to DISCARD_LIMIT) so the client sees the 413 instead of a reset socket.
  An accepted body is handed to the app from memory; later receive() calls (disconnect watching)
  go to the server.
- ApiKeys: with keys configured, every /v1/* route needs `Authorization: Bearer KEY` (compared in
  constant time); /health, /ready and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DISCARD_LIMIT = 64 << 20  # read at most this much of a refused body, then close the connection


async def send_error(send: Send, status: int, message: str, etype: str, code: int | str,
                     headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


class BodyLimit:
    def __init__(self, app: App, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, send: Send, size: str) -> Awaitable[None]:
        return send_error(send, 413, f"the request body ({size}) exceeds the server's limit of {self.max_bytes} "
                                     "bytes (--max-request-bytes)", "invalid_request_error", 413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        try:
            declared_n = int(declared) if declared is not None else None
        except ValueError:
            return await send_error(send, 400, "invalid Content-Length", "invalid_request_error", 400)
        chunks, total, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            more = msg.get("more_body", False)
            if (declared_n or 0) > self.max_bytes or total > self.max_bytes:
                while more and total <= DISCARD_LIMIT:  # drain, so the client reads our answer
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return
                    total += len(msg.get("body", b""))
                    more = msg.get("more_body", False)
                size = f"{declared_n} bytes" if declared_n is not None else f"more than {self.max_bytes} bytes"
                return await self._too_large(send, size)
            chunks.append(body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class ApiKeys:
    def __init__(self, app: App, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    def _ok(self, header: bytes | None) -> bool:
        if header is None or not header[:7].lower() == b"bearer ":
            return False
        given = header[7:].strip()
        ok = False
        for key in self.keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(given, key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if not self._ok(_header(scope, b"authorization")):
            return await send_error(send, 401, "invalid or missing API key: send Authorization: Bearer KEY",
                                    "invalid_request_error", "invalid_api_key",
                                    {"www-authenticate": 'Bearer realm="tandem"'})
        await self.app(scope, receive, send)
