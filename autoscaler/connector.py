"""The side-effect boundary of the autoscaler: how it reads and changes replica counts.

Role: the pure core (core.py) decides; a connector applies. `KubernetesConnector`
(kubernetes.py) patches the Deployments' scale subresource; a Ray connector implements the same
Protocol for `ray job submit` deployments. Tests use either a real connector against a double of
the platform, or a small in-memory implementation.

Contract:
- `get_replicas(phase)` returns the replicas asked for and the replicas ready to serve.
- `set_replicas(phase, replicas, expected=n)` is a compare-and-set: it changes the count only
  while the platform still says `n` (the count the decision was made from). If someone else
  changed it in the meantime the decision is stale: the connector leaves it alone and returns
  `SUPERSEDED`, and the next tick decides again from fresh numbers.
- Scale-down only lowers the count. Connectors never kill workers themselves: the platform sends
  SIGTERM and each worker drains (stops taking requests, finishes in-flight ones, exits).
- Failures the platform or network can cause raise `ScalingError`; every call has a deadline.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol, runtime_checkable

from autoscaler.core import Phase, ReplicaCounts
from common.errors import TandemError


class ScalingError(TandemError):
    """The platform refused or failed a replica read/change, or did not answer in time."""

    http_status = 503
    error_type = "scaling_error"


class ScaleOutcome(str, Enum):
    APPLIED = "applied"          # the platform now has the new count
    UNCHANGED = "unchanged"      # the platform already had the requested count
    SUPERSEDED = "superseded"    # someone else changed the count first; nothing was written


@runtime_checkable
class ScalingConnector(Protocol):
    def get_replicas(self, phase: Phase) -> ReplicaCounts:
        """Replicas asked for and replicas ready, for one phase."""
        ...

    def set_replicas(self, phase: Phase, replicas: int, *, expected: int) -> ScaleOutcome:
        """Compare-and-set the replica count of one phase (see the module docstring)."""
        ...
