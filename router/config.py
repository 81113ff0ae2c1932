"""RouterConfig: built once in router.main from flags (helm values map onto them 1:1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.prefill_cost import PrefillCost


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "gpt-oss"
    prefill: tuple[str, ...] = ()  # tcp://host:port, or host:port names with dns discovery
    decode: tuple[str, ...] = ()
    dns_discovery: bool = False
    colocated: bool = False  # prefill on the decode workers even when prefill workers exist
    poll_interval_s: float = 1.0
    rpc_timeout_s: float = 10.0
    prefill_timeout_s: float = 600.0  # the prefill RPC: queue + compute + transfer on the prefill worker
    transfer_deadline_s: float = 60.0  # the KV transfer from its start (the prefill worker bounds it)
    stream_timeout_s: float = 300.0
    max_attempts: int = 3
    max_model_len: int = 131072
    default_max_tokens: int = 0  # a request naming none: 0 = the room its context leaves (Handlers.default_max_tokens)
    knowledge_cutoff: str = "2024-06"
    served_models: tuple[str, ...] = field(default=())
    # overload, cancellation, drain, bounds, auth (issue 24)
    max_queued_requests: int = 1024  # admission queue bound by count: past it, 429
    max_queue_wait_s: float = 600.0  # admission queue bound by wait: past it, 429
    max_prefill_queue: int = 4  # requests per prefill worker (running + queued) before new ones wait here
    worker_grace_s: float = 30.0  # a worker marked down for missed polls: requests wait for it this long after its last answer
    request_timeout_s: float = 0.0  # whole request, arrival to last token; 0 = off
    drain_timeout_s: float = 60.0  # SIGTERM: in-flight requests get this long, then end with "abort"
    max_request_bytes: int = 4 << 20  # request bodies above this get 413 before parsing
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # non-empty: /v1/* needs one as a Bearer token
    prefill_cost: PrefillCost = field(default_factory=PrefillCost)  # local vs remote prefill of a cached prompt
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (LRU)
    builtin_tools: str = "ignore"  # /v1/responses built-in tools (web_search, ...): ignore | refuse (400)

    @property
    def reservation_s(self) -> float:
        """How long a decode worker holds pages reserved for a prefill's KV (AdmitRequest.deadline_s): past
        the prefill's queueing and compute, which the prefill timeout bounds, and its transfer. Before
        2026-12-05 this was the transfer deadline alone, so a prompt whose queueing and compute passed 60 s
        failed every attempt (a 30k-token prompt on the CPU stack: three ~4-min attempts, then 503)."""
        return self.prefill_timeout_s + self.transfer_deadline_s

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_models or (self.model_name,)
