"""The Ray path end to end, on a real local Ray cluster (head with dashboard, its own temp dir and
ports): `ray job submit -- tandem ray-launch --device cpu --autoscale` (dry run) with the tiny
checkpoint, a chat request through the unmodified `openai` client, prefill scaled 1 -> 2 -> 1
through the Ray connector (the router adopts the new worker; the surplus one drains and its
actor goes), then `ray job stop` in the middle of a stream: the stream completes, the launcher
drains and removes everything, and no tandem process, actor or placement group is left.

The tests share one cluster and one job and run in file order (the last one stops the job).
Every process of the cluster carries a marker in its environment, so the checks and the
teardown see only this cluster's processes (other Ray clusters may run on the same machine,
which is also why teardown does not use `ray stop`, which stops every cluster of the user).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
import ray.util.state  # noqa: E402
from openai import OpenAI  # noqa: E402

from autoscaler.connector import ScaleOutcome, ScalingError  # noqa: E402
from autoscaler.core import Phase, ReplicaCounts  # noqa: E402
from autoscaler.ray_connector import RayConnector  # noqa: E402
from launcher import ports  # noqa: E402
from launcher.ray_actors import ROUTER_ACTOR  # noqa: E402

MARKER_VAR = "TANDEM_RAY_TEST_MARKER"
NAMESPACE = "tandem-test"
TANDEM_TITLES = ("ray::TandemWorker", "ray::TandemRouter", "ray::FleetRegistry")
MARKER = f"{MARKER_VAR}={uuid.uuid4().hex}"
STREAM_TOKENS = 600  # long enough to be mid-stream when the job is stopped (~4-10 s here)


@dataclass(frozen=True)
class Cluster:
    gcs: str
    dashboard: str
    marker: str
    env: dict[str, str]


def _free_port() -> int:
    return ports.free_port()  # below the ephemeral range: a spawned process binds it later


def _marked() -> list[tuple[int, str]]:
    """(pid, command line) of every live process started by this test's cluster."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{d}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if MARKER.encode() in env and not zombie:
            out.append((int(d), cmd))
    return out


def _tandem_processes() -> list[str]:
    return [cmd for _, cmd in _marked()
            if "launcher.cli" in cmd or "ray-launch" in cmd or cmd.startswith(TANDEM_TITLES)]


def _wait_for(what: str, cond: Callable[[], object], timeout_s: float, poll_s: float = 0.5):
    t_end = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > t_end:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    ports = {k: _free_port() for k in (
        "port", "dashboard-port", "node-manager-port", "object-manager-port",
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port", "ray-client-server-port")}
    # Below Linux's ephemeral range (32768+), so none of the free ports above falls inside it.
    worker_lo = 10000 + (os.getpid() % 100) * 100
    temp = tempfile.mkdtemp(prefix="tr", dir="/tmp")  # short: Ray's unix sockets live under it
    bin_dir = str(Path(sys.executable).parent)  # `tandem` for the job's entrypoint
    # The code under test, whatever the installed package maps (an editable install made before
    # a package was added does not see it).
    repo = str(Path(__file__).resolve().parents[2])
    pypath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '')}", PYTHONPATH=pypath,
               **dict([MARKER.split("=", 1)]), RAY_USAGE_STATS_ENABLED="0")
    cmd = ["ray", "start", "--head", "--node-ip-address", "127.0.0.1", "--dashboard-host",
           "127.0.0.1", "--include-dashboard=true", "--num-cpus", "2", "--disable-usage-stats",
           "--temp-dir", temp, f"--min-worker-port={worker_lo}", f"--max-worker-port={worker_lo + 99}",
           f"--object-store-memory={200 << 20}", *(f"--{k}={v}" for k, v in ports.items())]
    r = subprocess.run([f"{bin_dir}/{cmd[0]}", *cmd[1:]], env=env, capture_output=True, text=True,
                       timeout=120)
    try:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        c = Cluster(gcs=f"127.0.0.1:{ports['port']}",
                    dashboard=f"http://127.0.0.1:{ports['dashboard-port']}", marker=MARKER, env=env)
        ray.init(address=c.gcs, namespace=NAMESPACE, log_to_driver=False)
        yield c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _kill_marked()
        shutil.rmtree(temp, ignore_errors=True)


def _kill_marked() -> None:
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid, _ in _marked():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        t_end = time.monotonic() + wait_s
        while _marked() and time.monotonic() < t_end:
            time.sleep(0.2)


def _ray_cli(c: Cluster, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    ray_bin = str(Path(sys.executable).parent / "ray")
    return subprocess.run([ray_bin, *args], env=c.env, capture_output=True, text=True,
                          timeout=timeout_s)


@dataclass(frozen=True)
class Job:
    id: str
    url: str


@pytest.fixture(scope="module")
def job(cluster: Cluster, ckpt_factory) -> Job:
    from ray.job_submission import JobStatus, JobSubmissionClient

    job_id = f"tandem-{uuid.uuid4().hex[:8]}"
    # The default 3 s between SIGTERM and SIGKILL is too short to drain; give the launcher 90 s.
    runtime_env = {"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "90"}}
    r = _ray_cli(cluster, "job", "submit", "--address", cluster.dashboard, "--submission-id", job_id,
                 "--no-wait", "--runtime-env-json", json.dumps(runtime_env), "--",
                 "tandem", "ray-launch", "--device", "cpu", "--checkpoint", ckpt_factory("tiny"),
                 "--port", "0", "--namespace", NAMESPACE, "--cpus-per-worker", "0.5",
                 "--kv-cache-gib", "0.0625", "--max-num-seqs", "8", "--model-name", "m",
                 "--router-poll-interval-s", "0.25", "--ready-timeout-s", "240",
                 "--drain-grace-s", "60", "--autoscale",
                 # Dry run: the autoscaler reads the router and the registry every second but
                 # leaves the counts to the scaling test.
                 "--autoscale-args", "--interval-s 1 --window-s 2 --dry-run")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    client = JobSubmissionClient(cluster.dashboard)

    def serving() -> str | None:
        status = client.get_job_status(job_id)
        logs = client.get_job_logs(job_id)
        if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.SUCCEEDED):
            raise AssertionError(f"job ended ({status}) before serving:\n{logs[-5000:]}")
        m = re.search(r"tandem is serving m at (http://\S+)/v1", logs)
        return m.group(1) if m else None

    return Job(job_id, _wait_for("the fleet to serve", serving, timeout_s=300, poll_s=1.0))


def _chat(url: str) -> None:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_chat_through_the_ray_fleet(job: Job) -> None:
    _chat(job.url)


def test_prefill_scales_up_and_down_through_the_connector(job: Job) -> None:
    conn = RayConnector.from_config(SimpleNamespace(namespace=NAMESPACE, api_timeout_s=10.0))
    router = ray.get_actor(ROUTER_ACTOR, namespace=NAMESPACE)

    def adopted_prefill() -> tuple[str, ...]:
        return ray.get(router.adopted.remote(), timeout=10)[0]

    def prefill_processes() -> int:
        return sum("prefill-worker" in cmd for _, cmd in _marked())

    assert conn.get_replicas(Phase.PREFILL) == ReplicaCounts(desired=1, ready=1)
    assert len(adopted_prefill()) == 1 and prefill_processes() == 1
    assert conn.set_replicas(Phase.PREFILL, 1, expected=1) is ScaleOutcome.UNCHANGED
    # A decision made from a stale count changes nothing.
    assert conn.set_replicas(Phase.PREFILL, 3, expected=2) is ScaleOutcome.SUPERSEDED
    with pytest.raises(ScalingError, match="at least 1"):  # refused inside the registry actor
        conn.set_replicas(Phase.DECODE, 0, expected=1)
    assert conn.set_replicas(Phase.PREFILL, 2, expected=1) is ScaleOutcome.APPLIED
    assert conn.get_replicas(Phase.PREFILL).desired == 2

    _wait_for("a second ready prefill worker", lambda: conn.get_replicas(Phase.PREFILL).ready == 2, 180)
    _wait_for("the router to adopt it", lambda: len(adopted_prefill()) == 2, 30)
    assert prefill_processes() == 2
    _chat(job.url)

    assert conn.set_replicas(Phase.PREFILL, 1, expected=2) is ScaleOutcome.APPLIED
    _wait_for("the surplus prefill worker to drain and exit", lambda: prefill_processes() == 1, 60)
    _wait_for("the router to drop it", lambda: len(adopted_prefill()) == 1, 30)
    assert conn.get_replicas(Phase.PREFILL) == ReplicaCounts(desired=1, ready=1)
    workers = [a for a in ray.util.state.list_actors(filters=[("state", "=", "ALIVE")])
               if a.class_name == "TandemWorker"]
    assert len(workers) == 2  # one prefill, one decode
    _chat(job.url)


def test_job_stop_drains_and_leaves_nothing(cluster: Cluster, job: Job) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert _tandem_processes(), "the fleet should be running before the stop"
    # A stream in flight when the job is stopped finishes: the fleet drains, it is not killed.
    client = OpenAI(base_url=job.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    streaming, got = threading.Event(), {}

    def stream() -> None:
        chunks = client.completions.create(
            model="m", prompt=[200006, 17360, 200008, 3, 99, 1234, 200007], max_tokens=STREAM_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        for c in chunks:
            streaming.set()
            if c.usage is not None:
                got["tokens"] = c.usage.completion_tokens
        got["end"] = time.monotonic()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(60), "the stream did not start"
    t0 = time.monotonic()
    r = _ray_cli(cluster, "job", "stop", "--address", cluster.dashboard, job.id)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    reader.join(60)
    assert got.get("tokens") == STREAM_TOKENS, got
    client = JobSubmissionClient(cluster.dashboard)
    _wait_for("the job to stop", lambda: client.get_job_status(job.id) == JobStatus.STOPPED, 90)
    logs = client.get_job_logs(job.id)
    # The launcher's own shutdown ran to the end (no SIGKILL from the job supervisor).
    assert "stopped: every worker drained or killed" in logs, logs[-3000:]
    assert "killing it" not in logs, logs[-3000:]
    assert "autoscaler running" in logs and "tick skipped" not in logs, logs[-3000:]
    # The decode worker got SIGTERM with the stream still running, and finished it.
    assert re.search(r"draining: refusing new requests, finishing [1-9]\d* in flight", logs), logs[-3000:]
    _wait_for("no tandem process left", lambda: not _tandem_processes(), 30)
    alive = [a.class_name for a in ray.util.state.list_actors(filters=[("state", "=", "ALIVE")])
             if a.class_name in ("TandemWorker", "TandemRouter", "FleetRegistry")]
    assert alive == []
    pgs = [p.name for p in ray.util.state.list_placement_groups()
           if p.state != "REMOVED" and p.name.startswith("tandem-")]
    assert pgs == []
    assert time.monotonic() - t0 < 90
