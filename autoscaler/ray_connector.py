"""Ray connector: prefill and decode replica counts of a `tandem ray-launch` fleet.

Role: implements `ScalingConnector` for deployments made with `ray job submit -- tandem
ray-launch`. The launcher registers a named actor, the fleet registry (`FleetRegistry`, actor
name `FLEET_ACTOR` in the launcher's Ray namespace), that plays the part the Deployment's
`spec.replicas` plays on Kubernetes: it holds the replicas asked for per phase, and the launcher
publishes into it how many workers are ready. The launcher's loop (launcher/ray_launch.py)
reconciles the actual worker actors to the asked-for counts.

Lifecycle of `set_replicas(phase, n, expected=e)`:
    registry.compare_and_set(phase, n, e)     one actor call with a deadline; the actor runs its
                                              methods one at a time, so read-compare-write is atomic
        desired == n: UNCHANGED;  desired != e: SUPERSEDED;  else desired := n, APPLIED
    launcher loop (next iteration, < 1 s):   starts workers, or picks victims and drains them:
                                              SIGTERM -> the worker finishes in-flight requests and
                                              exits -> then its actor and placement group go.
Like the Kubernetes connector, the connector only changes a number; it never stops a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from autoscaler.connector import ScaleOutcome, ScalingError
from autoscaler.core import Phase, ReplicaCounts
from common.errors import ConfigError, TandemError

log = logging.getLogger(__name__)

FLEET_ACTOR = "tandem-fleet"


class FleetRegistry:
    """The asked-for and ready replica counts of one fleet. Runs as a Ray actor (one method at a
    time, so each method is atomic); plain Python so the rules are testable without Ray.

    A fleet serves only with at least one decode worker and, unless it is colocated (decode
    workers prefill; no prefill workers at all), one prefill worker: asking for fewer raises
    `ScalingError`. There is no ceiling: workers that do not fit wait for resources (the
    autoscaler's --*-max-replicas bound what it asks for)."""

    def __init__(self, desired: dict[Phase, int], *, colocated: bool = False) -> None:
        self._colocated = colocated
        for phase in Phase:
            self._check(phase, desired[phase], ConfigError)
        self._desired = dict(desired)
        self._ready = {phase: 0 for phase in Phase}
        self._router_url = ""

    def _check(self, phase: Phase, replicas: int, error: type[TandemError]) -> None:
        if phase is Phase.PREFILL and self._colocated:
            if replicas != 0:
                raise error("prefill: this fleet is colocated (decode workers prefill); it has "
                            "no prefill workers to scale")
        elif replicas < 1:
            raise error(f"{phase.value}: the fleet needs at least 1 worker, not {replicas}")

    def get(self, phase: Phase) -> ReplicaCounts:
        return ReplicaCounts(desired=self._desired[phase], ready=self._ready[phase])

    def compare_and_set(self, phase: Phase, replicas: int, expected: int) -> ScaleOutcome:
        self._check(phase, replicas, ScalingError)
        have = self._desired[phase]
        if have == replicas:
            return ScaleOutcome.UNCHANGED
        if have != expected:
            return ScaleOutcome.SUPERSEDED
        self._desired[phase] = replicas
        return ScaleOutcome.APPLIED

    def desired(self) -> dict[Phase, int]:
        return dict(self._desired)

    def publish(self, ready: dict[Phase, int], router_url: str) -> None:
        """The launcher's loop reports what is serving, every iteration."""
        self._ready = dict(ready)
        self._router_url = router_url

    def router_url(self) -> str:
        """The fleet's OpenAI base URL without /v1 ("" until the router is up)."""
        return self._router_url


def _ray_get(ref: Any, timeout: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)


class RayConnector:
    """`ScalingConnector` over the fleet registry actor. Every call has a deadline; Ray failures
    (timeout, dead actor, a refused change) become `ScalingError`.

    `get` resolves an actor call (`ray.get`, injectable so the unit tests run without a cluster).
    The launcher uses the same client for `desired`/`publish`."""

    def __init__(self, registry: Any, *, timeout_s: float = 10.0,
                 get: Callable[[Any, float], Any] = _ray_get) -> None:
        if timeout_s <= 0:
            raise ConfigError("timeout_s must be > 0")
        self._registry = registry  # an ActorHandle of FleetRegistry
        self._timeout_s = timeout_s
        self._get = get

    @classmethod
    def from_config(cls, cfg: Any) -> RayConnector:
        """For `tandem autoscaler --connector ray`: attach to the cluster this process runs in
        (RAY_ADDRESS, or the local head) and find the fleet in Ray namespace `cfg.namespace`.
        The deployment names are not used: a namespace holds at most one fleet."""
        import ray

        if not ray.is_initialized():
            try:
                ray.init(address="auto", namespace=cfg.namespace, log_to_driver=False)
            except ConnectionError as exc:
                raise ConfigError(f"--connector ray: no Ray cluster to attach to: {exc}") from exc
        try:
            actor = ray.get_actor(FLEET_ACTOR, namespace=cfg.namespace)
        except ValueError as exc:
            raise ConfigError(f"--connector ray: no tandem fleet in Ray namespace "
                              f"{cfg.namespace!r} (is `tandem ray-launch --namespace "
                              f"{cfg.namespace}` running?)") from exc
        return cls(actor, timeout_s=cfg.api_timeout_s)

    def _call(self, what: str, ref: Any) -> Any:
        from ray.exceptions import GetTimeoutError, RayError, RayTaskError

        try:
            return self._get(ref, self._timeout_s)
        except GetTimeoutError as exc:
            raise ScalingError(f"{what}: the fleet registry did not answer within "
                               f"{self._timeout_s}s") from exc
        except RayTaskError as exc:
            cause = exc.cause
            msg = cause.message if isinstance(cause, ScalingError) else repr(cause)
            raise ScalingError(f"{what}: {msg}") from exc
        except RayError as exc:  # dead actor, lost connection to the cluster
            raise ScalingError(f"{what}: the fleet registry is unreachable: {exc}") from exc

    def get_replicas(self, phase: Phase) -> ReplicaCounts:
        counts = self._call(f"get {phase.value}", self._registry.get.remote(phase))
        assert isinstance(counts, ReplicaCounts), counts
        return counts

    def set_replicas(self, phase: Phase, replicas: int, *, expected: int) -> ScaleOutcome:
        assert replicas >= 0, replicas
        outcome = self._call(f"set {phase.value} to {replicas}",
                             self._registry.compare_and_set.remote(phase, replicas, expected))
        assert isinstance(outcome, ScaleOutcome), outcome
        if outcome is ScaleOutcome.SUPERSEDED:
            log.info("%s: the fleet is no longer at %d replicas; leaving it", phase.value, expected)
        return outcome

    def desired(self) -> dict[Phase, int]:
        return self._call("read desired replicas", self._registry.desired.remote())

    def publish(self, ready: dict[Phase, int], router_url: str) -> None:
        self._call("publish ready replicas", self._registry.publish.remote(ready, router_url))

    def router_url(self) -> str:
        return self._call("read the router URL", self._registry.router_url.remote())
