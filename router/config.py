"""RouterConfig: built once in router.main from flags (helm values map onto them 1:1)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    prefill_timeout_s: float = 600.0
    transfer_deadline_s: float = 60.0
    stream_timeout_s: float = 300.0
    max_attempts: int = 3
    max_model_len: int = 131072
    default_max_tokens: int = 4096
    knowledge_cutoff: str = "2024-06"
    served_models: tuple[str, ...] = field(default=())
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (LRU)

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.served_models or (self.model_name,)
