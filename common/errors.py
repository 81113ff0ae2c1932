"""Typed errors. Anything a user, a config file or the network can cause raises one of these;
`assert` is kept for internal invariants only. The router maps `http_status` onto the response.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base class: a clear message plus the HTTP status and OpenAI error type it maps to."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(TandemError):
    """A config.json, flag or preset is invalid."""

    http_status = 500
    error_type = "config_error"


class CheckpointError(TandemError):
    """A checkpoint is missing tensors, has wrong shapes or an unknown quantisation method."""

    http_status = 500
    error_type = "checkpoint_error"


class InvalidRequest(TandemError):
    """The client sent something we cannot serve (bad parameter, too long a prompt)."""

    http_status = 400
    error_type = "invalid_request_error"


class NotFound(TandemError):
    """The request names something this server does not have (a stored response id)."""

    http_status = 404
    error_type = "invalid_request_error"


class ModelNotFound(TandemError):
    http_status = 404
    error_type = "model_not_found"


class AdmissionRejected(TandemError):
    """A worker refused a request (no KV room, queue full); the router may retry elsewhere."""

    http_status = 503
    error_type = "overloaded"


class WorkerLate(AdmissionRejected):
    """No worker of a needed role is live, but one that was ready stopped answering its status polls
    less than the grace period ago (a loaded host, not a dead one): the request waits in the router's
    queue like any AdmissionRejected one. Clients see QueueFull (429) past the queue's wait bound, or
    WorkerUnavailable (503) once the grace period runs out; this status is only a fallback."""

    http_status = 503
    error_type = "service_unavailable"


class WorkerUnavailable(TandemError):
    """No worker answered within the deadline."""

    http_status = 503
    error_type = "service_unavailable"


class TransferFailed(TandemError):
    """A KV transfer ended in failure (deadline, epoch, peer death, handshake mismatch)."""

    http_status = 503
    error_type = "kv_transfer_failed"


class ProtocolError(TandemError):
    """A wire message was malformed, too large, or of an incompatible version."""

    http_status = 502
    error_type = "protocol_error"
