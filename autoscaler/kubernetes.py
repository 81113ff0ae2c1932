"""Kubernetes connector: prefill and decode are two Deployments, scaled through `/scale`.

Role: implements `ScalingConnector` with the official `kubernetes` client. Reads the Deployment
(spec replicas, ready replicas); writes only the scale subresource, which is all the RBAC Role in
the helm chart grants write access to (get/list deployments, get/patch deployments/scale).

Lifecycle of `set_replicas(phase, n, expected=e)`:
    GET  .../deployments/NAME/scale           -> replicas r, resourceVersion v
    r == n: UNCHANGED;  r != e: SUPERSEDED (someone else scaled; the decision is stale)
    PATCH .../deployments/NAME/scale  {metadata.resourceVersion: v, spec.replicas: n}
                                     (JSON merge patch: the API server rejects a stale v with 409)
    409 -> brief backoff, back to GET (controllers bump resourceVersion all the time, e.g. on
           status updates, so a conflict usually just means "read again"); bounded retries.
Scale-down only lowers `spec.replicas`: the ReplicaSet controller picks the pods and the kubelet
sends SIGTERM; each worker drains within terminationGracePeriodSeconds. We never delete pods.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from autoscaler.connector import ScaleOutcome, ScalingError
from autoscaler.core import Phase, ReplicaCounts
from common.errors import ConfigError

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
FIELD_MANAGER = "tandem-autoscaler"


@dataclass(frozen=True, slots=True)
class KubernetesTargets:
    namespace: str
    prefill_deployment: str
    decode_deployment: str

    def name(self, phase: Phase) -> str:
        return self.prefill_deployment if phase is Phase.PREFILL else self.decode_deployment


def load_api(kubeconfig: str | None) -> k8s.AppsV1Api:
    """In-cluster service-account credentials when running in a pod, else a kubeconfig file."""
    try:
        if kubeconfig is None:
            try:
                k8s_config.load_incluster_config()
                return k8s.AppsV1Api()
            except ConfigException:
                pass  # not in a pod: fall back to ~/.kube/config or $KUBECONFIG
        k8s_config.load_kube_config(config_file=kubeconfig)
    except (ConfigException, OSError) as exc:
        raise ConfigError(f"no usable Kubernetes credentials: {exc}") from exc
    return k8s.AppsV1Api()


class KubernetesConnector:
    """`ScalingConnector` over the Deployment scale subresource, with optimistic concurrency."""

    def __init__(self, apps: k8s.AppsV1Api, targets: KubernetesTargets, *,
                 request_timeout_s: float = 10.0, max_conflict_retries: int = 5,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if request_timeout_s <= 0 or max_conflict_retries < 0:
            raise ConfigError("request_timeout_s must be > 0 and max_conflict_retries >= 0")
        self._apps = apps
        self._targets = targets
        self._timeout_s = request_timeout_s
        self._max_conflict_retries = max_conflict_retries
        self._sleep = sleep
        self.conflicts_seen = 0  # lifetime count, exported by main.py

    def _call(self, what: str, fn: Callable[..., object], *args: object,
              **kwargs: object) -> object:
        try:
            return fn(*args, _request_timeout=self._timeout_s, **kwargs)
        except ApiException:
            raise  # callers decide what each status means
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ScalingError(f"{what}: API server unreachable or too slow "
                               f"(deadline {self._timeout_s}s): {exc}") from exc

    def get_replicas(self, phase: Phase) -> ReplicaCounts:
        name, ns = self._targets.name(phase), self._targets.namespace
        try:
            dep = self._call(f"get deployment {ns}/{name}", self._apps.read_namespaced_deployment,
                             name, ns)
        except ApiException as exc:
            raise ScalingError(f"get deployment {ns}/{name}: HTTP {exc.status} {exc.reason}") \
                from exc
        assert isinstance(dep, k8s.V1Deployment)
        desired = dep.spec.replicas if dep.spec is not None else None
        ready = dep.status.ready_replicas if dep.status is not None else None
        # The API server defaults spec.replicas to 1; an absent readyReplicas means none ready.
        return ReplicaCounts(desired=1 if desired is None else desired, ready=ready or 0)

    def set_replicas(self, phase: Phase, replicas: int, *, expected: int) -> ScaleOutcome:
        assert replicas >= 0, replicas
        name, ns = self._targets.name(phase), self._targets.namespace
        for attempt in range(self._max_conflict_retries + 1):
            scale = self._read_scale(name, ns)
            have = scale.spec.replicas if scale.spec is not None else None
            have = 0 if have is None else have
            if have == replicas:
                return ScaleOutcome.UNCHANGED
            if have != expected:
                log.info("%s: %s/%s is at %d, not the %d we decided from; leaving it",
                         phase.value, ns, name, have, expected)
                return ScaleOutcome.SUPERSEDED
            body = {"metadata": {"resourceVersion": scale.metadata.resource_version},
                    "spec": {"replicas": replicas}}
            try:
                patched = self._call(
                    f"patch scale {ns}/{name}", self._apps.patch_namespaced_deployment_scale,
                    name, ns, body, field_manager=FIELD_MANAGER, _content_type=MERGE_PATCH)
            except ApiException as exc:
                if exc.status != 409:
                    raise ScalingError(f"patch scale {ns}/{name}: HTTP {exc.status} "
                                       f"{exc.reason}") from exc
                self.conflicts_seen += 1
                log.info("%s: resourceVersion conflict on %s/%s (attempt %d), re-reading",
                         phase.value, ns, name, attempt + 1)
                # Jittered backoff so two writers do not collide in lockstep.
                self._sleep(min(0.05 * 2 ** attempt, 1.0) * random.uniform(0.5, 1.0))
                continue
            assert isinstance(patched, k8s.V1Scale)
            got = patched.spec.replicas if patched.spec is not None else None
            if got != replicas:
                raise ScalingError(f"patch scale {ns}/{name}: asked for {replicas}, the API "
                                   f"server answered {got}")
            return ScaleOutcome.APPLIED
        raise ScalingError(f"patch scale {ns}/{name}: still conflicting after "
                           f"{self._max_conflict_retries + 1} attempts")

    def _read_scale(self, name: str, ns: str) -> k8s.V1Scale:
        try:
            scale = self._call(f"get scale {ns}/{name}",
                               self._apps.read_namespaced_deployment_scale, name, ns)
        except ApiException as exc:
            raise ScalingError(f"get scale {ns}/{name}: HTTP {exc.status} {exc.reason}") from exc
        assert isinstance(scale, k8s.V1Scale)
        if scale.metadata is None or not scale.metadata.resource_version:
            raise ScalingError(f"get scale {ns}/{name}: the answer has no resourceVersion")
        return scale
