"""Prometheus metrics of the KV transfer, labelled by role ("prefill" = sender, "decode" = receiver).

Registered once at import in the default registry, which the workers' /metrics endpoint exposes.
Bytes are counted as they are written (sender) or confirmed landed (receiver); duration and
failures once per request, when it turns terminal.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kv_transfer.interface import TransferOutcome, TransferStatus

BYTES = Counter("tandem_kv_transfer_bytes", "KV payload bytes moved by transfers", ["role"])
SECONDS = Histogram("tandem_kv_transfer_seconds", "Transfer duration from start to a terminal status",
                    ["role", "status"],
                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
FAILURES = Counter("tandem_kv_transfer_failures", "Failed transfers by reason", ["role", "reason"])
WRITES = Counter("tandem_kv_transfer_writes", "WRITE steps the prefill side posted, by data path (nixl | ipc)",
                 ["path"])
STALE = Counter("tandem_kv_transfer_stale_messages", "Dropped messages of another epoch or request", ["role"])
QUARANTINED_PAGES = Gauge("tandem_kv_transfer_quarantined_pages",
                          "Decode pages held because a peer may still write into them", ["group"])


def record_outcome(role: str, outcome: TransferOutcome) -> None:
    SECONDS.labels(role=role, status=outcome.status.name.lower()).observe(outcome.seconds)
    if outcome.status == TransferStatus.FAILED:
        assert outcome.reason is not None
        FAILURES.labels(role=role, reason=outcome.reason.label).inc()
    elif role == "decode":
        BYTES.labels(role=role).inc(outcome.num_bytes)
