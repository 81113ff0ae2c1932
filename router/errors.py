"""The router's own typed errors (HTTP edge and admission), on top of common.errors.

Each maps onto an OpenAI error body {"error": {"message", "type", "param", "code"}}; `code` is the
HTTP status unless a class names a string code (OpenAI's `invalid_api_key`), and `headers` are
sent with the response (Retry-After on 429).
"""

from __future__ import annotations

from common.errors import TandemError


class QueueFull(TandemError):
    """The admission queue is at its bound (count or wait): come back later (OpenAI's 429)."""

    http_status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(max(1, retry_after_s))}


class ServiceDraining(TandemError):
    """The router is shutting down: it takes no new request, and ends what outlives the drain."""

    http_status = 503
    error_type = "service_unavailable"


class RequestTimedOut(TandemError):
    """The request ran past --request-timeout-s; it was aborted on its workers."""

    http_status = 504
    error_type = "timeout"


class RequestTooLarge(TandemError):
    http_status = 413
    error_type = "invalid_request_error"


class InvalidApiKey(TandemError):
    http_status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


def error_code(e: TandemError) -> int | str:
    return getattr(e, "code", e.http_status)
