"""Generates helm/tandem/values.schema.json, the strict schema of the chart's values.

Role: the schema is long and repetitive (prefill and decode are mirror images; every pod has
the same scheduling keys), so it is written once here and rendered to JSON. Every object is
closed (`additionalProperties: false`) and every leaf typed, so a typo or a wrong type in a
values file fails `helm lint`/`helm template` instead of being silently ignored.

Usage (from the repository root):
    python helm/gen_schema.py            # rewrite helm/tandem/values.schema.json
    python helm/gen_schema.py --check    # exit 1 if the committed file is stale
tests/unit/test_helm_schema.py runs the check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SCHEMA_PATH = Path(__file__).resolve().parent / "tandem" / "values.schema.json"

Schema = dict[str, object]


def _t(kind: str, **kw: object) -> Schema:
    return {"type": kind, **kw}


def _str(**kw: object) -> Schema:
    return _t("string", **kw)


def _int(**kw: object) -> Schema:
    return _t("integer", **kw)


def _num(**kw: object) -> Schema:
    return _t("number", **kw)


def _bool() -> Schema:
    return _t("boolean")


def _pos() -> Schema:
    return _num(exclusiveMinimum=0)


def _ref(name: str) -> Schema:
    return {"$ref": f"#/$defs/{name}"}


def _obj(props: dict[str, Schema], required: list[str] | None = None,
         **kw: object) -> Schema:
    """A closed object; every property is required unless `required` says otherwise (values
    are always merged over values.yaml, so a missing key means someone nulled it)."""
    out: Schema = {"type": "object", "properties": props, **kw}
    req = list(props) if required is None else required
    if req:
        out["required"] = req
    out["additionalProperties"] = False
    return out


DEFS: dict[str, Schema] = {
    "port": _int(minimum=1, maximum=65535),
    "quantity": {"oneOf": [_str(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$"),
                           _num(minimum=0)],
                 "description": 'a Kubernetes quantity, e.g. 8, "500m", "64Gi"'},
    "resourceName": _str(pattern=r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?"
                                 r"[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$"),
    "resourceList": {"type": "object", "propertyNames": _ref("resourceName"),
                     "additionalProperties": _ref("quantity")},
    "resources": _obj({"requests": _ref("resourceList"), "limits": _ref("resourceList")},
                      required=[], description="GPUs and RDMA devices are added by the chart"),
    "probe": _obj({"periodSeconds": _int(minimum=1), "failureThreshold": _int(minimum=1),
                   "timeoutSeconds": _int(minimum=1)}),
    "probes": _obj({"startup": _ref("probe"), "liveness": _ref("probe"),
                    "readiness": _ref("probe")},
                   description="startup bounds the model load (period x threshold); "
                               "liveness on /health, readiness on /ready"),
    "podDisruptionBudget": _obj({"enabled": _bool(), "maxUnavailable": {
        "oneOf": [_int(minimum=0), _str(pattern=r"^[0-9]{1,3}%$")]}}),
    "stringMap": {"type": "object", "additionalProperties": _str()},
    "toleration": _obj({"key": _str(), "operator": _str(enum=["Exists", "Equal"]),
                        "value": _str(),
                        "effect": _str(enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
                        "tolerationSeconds": _int()}, required=[]),
    "tolerations": {"type": "array", "items": _ref("toleration")},
    "affinity": _obj({"nodeAffinity": _t("object"), "podAffinity": _t("object"),
                      "podAntiAffinity": _t("object")}, required=[]),
    "extraArgs": {"type": "array", "items": _str(minLength=1)},
    "envVar": _obj({"name": _str(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"), "value": _str(),
                    "valueFrom": _t("object")}, required=["name"]),
    "extraEnv": {"type": "array", "items": _ref("envVar")},
    "tensorParallel": _int(enum=[1, 2, 4, 8],
                           description="TP ranks = GPUs per pod (8 KV heads, so TP <= 8)"),
    "kvCache": _obj({
        "dtype": _str(enum=["auto", "bf16", "fp8"],
                      description="--kv-cache-dtype; auto = the model dtype; fp8 = e4m3 pages (half the bytes)"),
        "scaleCalibration": _int(minimum=0, maximum=64,
                                 description="--kv-scale-calibration: FP8 KV scales from N prompts (0: checkpoint or 1.0)"),
    }, description="KV cache pages; prefill and decode must agree"),
    "nixl": _obj({
        "ucxTls": _str(minLength=1, description="UCX_TLS"),
        "ucxNetDevices": _str(description="UCX_NET_DEVICES; empty lets UCX choose"),
        "rdma": _obj({"resourceName": _ref("resourceName"), "count": _int(minimum=0)}),
        "shmSizeLimit": _str(pattern=r"^[0-9]+(Ki|Mi|Gi|Ti)$"),
        "ipcLock": _bool()}),
}

POD_COMMON: dict[str, Schema] = {
    "nodeSelector": _ref("stringMap"), "tolerations": _ref("tolerations"),
    "affinity": _ref("affinity"), "podAnnotations": _ref("stringMap"),
    "extraArgs": _ref("extraArgs"), "extraEnv": _ref("extraEnv"),
}


def _worker(role: str, parallelism: Schema, extra: dict[str, Schema]) -> Schema:
    """prefill and decode share every key; decode adds `engine`, prefill pins its MoE mode."""
    return _obj({
        "replicas": _int(minimum=0, description="not applied while autoscaler.enabled"),
        "parallelism": parallelism, "port": _ref("port"), "metricsPort": _ref("port"),
        "fp8": _bool(), "piecewiseGraphs": _bool(), "kvCache": _ref("kvCache"), "nixl": _ref("nixl"),
        "resources": _ref("resources"),
        "probes": _ref("probes"),
        "podDisruptionBudget": _ref("podDisruptionBudget"), **POD_COMMON, **extra,
    }, description=f"{role} workers (mirror image of the other phase)")


PREFILL = _worker("prefill", _obj({
    "tensor": _ref("tensorParallel"),
    "expert": _int(const=1, description="prefill runs TP-only MoE"),
    "moeMode": _str(const="tp")}), {})

DECODE = _worker("decode", _obj({
    "tensor": _ref("tensorParallel"),
    "expert": _int(enum=[1, 2, 4, 8], description="1 with moeMode tp, = tensor with ep"),
    "moeMode": _str(enum=["tp", "ep"])}), {
    "engine": _obj({"maxNumSeqs": _int(minimum=1, maximum=4096),
                    "kvCacheFraction": _num(exclusiveMinimum=0, maximum=1),
                    "cudaGraphs": _bool()})})

TCP_ADDR = _str(pattern=r"^tcp://[^:/\s]+:[0-9]{1,5}$")

ROUTER = _obj({
    "replicas": _int(minimum=1), "port": _ref("port"), "discovery": _str(enum=["k8s", "static"]),
    "staticPrefill": {"type": "array", "items": TCP_ADDR},
    "staticDecode": {"type": "array", "items": TCP_ADDR},
    "service": _obj({"type": _str(enum=["ClusterIP", "NodePort", "LoadBalancer"]),
                     "port": _ref("port"), "annotations": _ref("stringMap")}),
    "resources": _ref("resources"), "probes": _ref("probes"),
    "preStopSleepSeconds": _int(minimum=0, description="keep serving while the endpoint leaves the Service"),
    "admission": _obj({"maxQueuedRequests": _int(minimum=0), "maxQueueWaitSeconds": _pos(),
                       "maxPrefillQueue": _int(minimum=1),
                       "workerGraceSeconds": _num(minimum=0, description="requests wait this long after a "
                                                  "worker's last status answer before 503; 0 = no grace")},
                      description="the router's queue: past either bound, 429 with Retry-After"),
    "requestTimeoutSeconds": _num(minimum=0, description="abort requests running longer; 0 = no limit"),
    "maxRequestBytes": _int(minimum=1024, description="larger request bodies get 413"),
    "apiKeys": _obj({"enabled": _bool(),
                     "existingSecret": _str(description="a Secret with the keys, comma-separated, under secretKey"),
                     "secretKey": _str(minLength=1),
                     "keys": {"type": "array", "items": _str(minLength=8),
                              "description": "without existingSecret: the chart stores these in a Secret"}}),
    "podDisruptionBudget": _ref("podDisruptionBudget"), **POD_COMMON,
})

DRAIN = _obj({"timeoutSeconds": _int(minimum=0, description="--drain-timeout-s of router, prefill and decode"),
              "marginSeconds": _int(minimum=0, description="terminationGracePeriodSeconds = preStop + drain + "
                                                           "this")})

AUTOSCALER = _obj({
    "enabled": _bool(), "intervalS": _pos(), "windowS": _pos(), "metricsPort": _ref("port"),
    "slo": _obj({"ttftP50S": _pos(), "ttftP90S": _pos(), "itlP50S": _pos(), "itlP90S": _pos(),
                 "upFraction": _pos(), "downFraction": _pos()}),
    "prefill": _obj({"minReplicas": _int(minimum=1), "maxReplicas": _int(minimum=1),
                     "queueUp": _pos(), "queueDown": _num(minimum=0)}),
    "decode": _obj({"minReplicas": _int(minimum=1), "maxReplicas": _int(minimum=1),
                    "queueUp": _pos(), "queueDown": _num(minimum=0),
                    "kvUp": _num(exclusiveMinimum=0, maximum=1),
                    "kvDown": _num(minimum=0, maximum=1),
                    "routerQueueUp": _pos(), "routerQueueDown": _num(minimum=0),
                    "routerWaitUpS": _pos(), "routerWaitDownS": _num(minimum=0)}),
    "maxStepUp": _int(minimum=1), "maxStepDown": _int(minimum=1),
    "scaleUpCooldownS": _num(minimum=0), "scaleDownCooldownS": _num(minimum=0),
    "scaleDownStabilizationS": _num(minimum=0),
    "resources": _ref("resources"), **POD_COMMON,
})


def schema() -> Schema:
    root = _obj({
        "nameOverride": _str(), "fullnameOverride": _str(),
        "image": _obj({"repository": _str(minLength=1), "tag": _str(),
                       "pullPolicy": _str(enum=["Always", "IfNotPresent", "Never"])}),
        "imagePullSecrets": {"type": "array", "items": _obj({"name": _str(minLength=1)})},
        "model": _obj({"name": _str(minLength=1), "path": _str(pattern=r"^[^/].*$"),
                       "mountPath": _str(pattern=r"^/.+"),
                       "volume": _obj({"type": _str(enum=["hostPath", "pvc"]),
                                       "hostPath": _str(pattern=r"^/"),
                                       "claimName": _str()})}),
        "accelerator": _obj({"resourceName": _ref("resourceName")}),
        "drain": DRAIN, "router": ROUTER, "prefill": PREFILL, "decode": DECODE, "autoscaler": AUTOSCALER,
        "serviceMonitor": _obj({"enabled": _bool(),
                                "interval": _str(pattern=r"^[0-9]+(ms|s|m|h)$"),
                                "labels": _ref("stringMap")}),
    })
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "tandem Helm chart values", **root, "$defs": DEFS}


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is stale: run python helm/gen_schema.py", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
