"""GPU suites (benchmarks/suites.py, suite_run.py, gpu_env.py) on the CPU: the registry is well formed
(every module and test file a step names exists, every suite fits one device call, multicast stays
off), and the runner runs a tiny suite of CPU steps end to end: statuses (ok, failed, timeout, skipped),
background processes stopped, suite.json (command, commit, date, GPU, versions) and the table last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_env, suite_run
from benchmarks.suites import SUITE_BUDGET_S, SUITES, Step, Suite, step

REPO = Path(__file__).resolve().parents[2]
EXTERNAL = {"pytest", "torch.distributed.run"}
KINDS = {"nvidia-h200", "nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8", "cpu"}
CARRIES = {".whl", ".whl-nixl", ".whl-site", ".cache/dgcarry", ".cache/fi"}


@pytest.mark.parametrize("name", sorted(SUITES))
def test_registry_suite_is_runnable_as_written(name: str):
    suite = SUITES[name]
    assert suite.total_timeout_s() <= min(suite.budget_s, SUITE_BUDGET_S), "must fit one device call"
    assert suite.kind in KINDS and set(suite.carry) <= CARRIES and suite.steps
    names = [s.name for s in suite.steps]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[a-z0-9][a-z0-9_-]*", n) for n in names)
    published = [p for s in suite.steps for _, p in s.publish]
    assert len(set(published)) == len(published)
    for s in suite.steps:
        assert not set(dict(s.env)) & set(gpu_env.NO_MULTICAST), "multicast must stay off"
        for argv in (s.argv, *(cmd for _, cmd in s.background)):
            assert argv[0] == "{py}", argv
            assert argv[1] == "-m", argv
            mods = [argv[2]] + ([argv[argv.index("-m", 3) + 1]] if argv[2] == "torch.distributed.run" else [])
            for mod in mods:
                if mod not in EXTERNAL:
                    path = REPO / (mod.replace(".", "/") + ".py")
                    assert path.is_file(), f"{name}/{s.name}: no module {mod}"
                    # a syntax error would cost a device call (it needs no GPU library to show)
                    compile(path.read_text(), str(path), "exec")
            for a in argv:
                if a.startswith("tests/"):
                    assert (REPO / a).is_file(), f"{name}/{s.name}: no test file {a}"
        if "benchmarks.bench_model" in s.argv and suite.gpu and (name, s.name) not in UNPUBLISHED:
            assert f"model_{s.argv[s.argv.index('--tag') + 1]}.json" in dict(s.publish), s  # the file bench_model writes


# bench_model steps whose JSON stays in its run folder: fp8-gemv-ab's two are an A/B of the QKV/O dtype, which the
# report's labels do not show, and a defaults run of fewer batch sizes would displace the summary's fuller one.
UNPUBLISHED = {("fp8-gemv-ab", "model-20b-bf16"), ("fp8-gemv-ab", "model-20b-fp8")}


def _py(code: str) -> tuple[str, ...]:
    return ("{py}", "-c", code)


def _fake_suite(pidfile: Path) -> Suite:
    write = ("import json, os, pathlib; p = pathlib.Path(os.environ['OUT']); "
             "(p / 'x.json').write_text(json.dumps({'nvls': os.environ['NCCL_NVLS_ENABLE']})); "
             "print('line one'); print('result: 42 things'); print('trailing')")
    serve = (f"import os, time, pathlib; pathlib.Path({str(pidfile)!r}).write_text(str(os.getpid())); "
             "print('serving', flush=True); time.sleep(120)")
    client = f"import pathlib, time; p = pathlib.Path({str(pidfile)!r})\nwhile not p.exists(): time.sleep(0.05)\nprint('ok')"
    return Suite("a tiny CPU suite", carry=(), gpu=False, kind="cpu", steps=(
        Step("writes", _py(write), 60, summary=r"^result", publish=(("x.json", "kernels_x.json"),), gpus=0),
        Step("fails", _py("import sys; print('boom'); sys.exit(3)"), 60, gpus=0),
        Step("hangs", _py("import time; print('start', flush=True); time.sleep(60)"), 2, gpus=0),
        Step("with-worker", _py(client), 60, background=(("worker", _py(serve)),), gpus=0),
        Step("needs-gpus", _py("print('never')"), 60, gpus=2),
    ))


def test_runner_runs_a_cpu_suite_and_records_it(tmp_path, capsys):
    pidfile = tmp_path / "worker.pid"
    out = tmp_path / "run"
    t0 = time.monotonic()
    rc = suite_run.main(["fake", "--out", str(out), "--budget", "120"], suites={"fake": _fake_suite(pidfile)})
    assert rc == 1  # one step failed, one timed out
    assert time.monotonic() - t0 < 60
    rec = json.loads((out / "suite.json").read_text())
    assert rec["runner"] == suite_run.RUNNER and rec["suite"] == "fake" and rec["args"][0] == "fake"
    assert rec["command"] and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", rec["date"])
    assert rec["git"]["source"] == "git" and re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"])
    assert isinstance(rec["git"]["dirty"], bool)
    assert rec["versions"]["torch"] and "triton" in rec["versions"] and "cuda" in rec["versions"] and rec["gpu"]
    st = {s["name"]: s for s in rec["steps"]}
    assert st["writes"]["status"] == "ok" and st["writes"]["summary"] == "result: 42 things"
    assert json.loads((out / "writes" / "x.json").read_text()) == {"nvls": "0"}  # multicast off in every step
    assert rec["published"] == {"kernels_x.json": "writes/x.json"} and "writes/step.log" in st["writes"]["files"]
    assert st["fails"]["status"] == "failed (rc 3)" and st["fails"]["summary"] == "boom"
    assert st["hangs"]["status"].startswith("timeout") and st["hangs"]["seconds"] < 15
    assert st["with-worker"]["status"] == "ok" and st["with-worker"]["background"]["worker"]["rc"] is not None
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker was stopped with its step
    assert (out / "with-worker" / "worker.log").read_text().startswith("serving")
    assert st["needs-gpus"]["status"].startswith("skipped: needs 2 GPU(s)")
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-1].startswith("3/5 steps ok or skipped") and lines[-8].startswith("suite fake @ ")
    assert re.match(r"hangs +timeout \(2 s\) +\d+ +start$", lines[-4])


def test_tar_leaves_one_archive_and_only_runs_the_chosen_steps(tmp_path, capsys):
    out = tmp_path / "run"
    rc = suite_run.main(["fake", "--out", str(out), "--tar", "--only", "writes"],
                        suites={"fake": _fake_suite(tmp_path / "pid")})
    assert rc == 0 and not out.exists()
    with tarfile.open(tmp_path / "run.tgz") as t:
        names = t.getnames()
        rec = json.load(t.extractfile("run/suite.json"))
    assert "run/writes/x.json" in names and [s["name"] for s in rec["steps"]] == ["writes"]
    assert "run.tgz" in capsys.readouterr().out.splitlines()[-1]


def test_budget_cuts_step_timeouts(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_env, "versions", lambda env, repo: {"gpu": "none"})
    monkeypatch.setattr(suite_run, "MIN_STEP_S", 1)
    suite = Suite("x", carry=(), gpu=False, kind="cpu",
                  steps=(Step("a", _py("import time; time.sleep(30)"), 300, gpus=0), Step("b", _py("pass"), 5, gpus=0)))
    rc, rec = suite_run.run_suite("x", suite, tmp_path / "o", "cmd", [], budget_s=suite_run.RESERVE_S + 3)
    assert rc == 1 and rec["steps"][0]["status"].startswith("timeout") and rec["steps"][1]["status"].startswith("not run")


def test_git_commit_comes_from_the_caller_first(tmp_path):
    env = {"TANDEM_GIT_COMMIT": "a" * 40, "TANDEM_GIT_DIRTY": "0"}
    want = {"commit": "a" * 40, "dirty": False, "source": "TANDEM_GIT_COMMIT (set by the caller)"}
    assert suite_run.git_state(tmp_path, env) == want
    assert suite_run.git_state(REPO, env) == want  # even where a (possibly stale) .git is present
    assert suite_run.git_state(tmp_path, {})["commit"] is None


def test_device_call_names_kind_carry_and_commit():
    text = suite_run.device_call("model", SUITES["model"])
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert "kind='nvidia-h200'" in text and "'.cache/dgcarry'" in text
    assert f"TANDEM_GIT_COMMIT={head}" in text and "bench suite model --out $OUT/model --tar" in text


def test_gpu_setup_unpacks_the_deepgemm_carry_and_keeps_multicast_off(tmp_path):
    repo = tmp_path / "repo"
    src = tmp_path / "src" / "deep_gemm"
    (src / "include").mkdir(parents=True)
    (src / "VERSION").write_text("0.2.0\n")
    (src / "include" / "x.cuh").write_text("//")
    carry = repo / gpu_env.DG_CARRY
    carry.mkdir(parents=True)
    with tarfile.open(carry / "headers.tar.xz", "w:xz") as t:
        t.add(src, arcname="deep_gemm")
    launchers = tmp_path / "l" / "deepgemm"
    launchers.mkdir(parents=True)
    (launchers / "a.so").write_bytes(b"\0")
    with tarfile.open(carry / "launchers.tar.xz", "w:xz") as t:
        t.add(launchers, arcname="deepgemm")
    paths = gpu_env.SetupPaths(repo=repo, site=tmp_path / "site", dg_root=tmp_path / "dg",
                               flashinfer_workspace=tmp_path / "fi")
    env, rec = gpu_env.setup((".whl", gpu_env.DG_CARRY), gpu=True, paths=paths)
    assert env["TANDEM_DEEPGEMM_INCLUDE"] == str(tmp_path / "dg" / "deep_gemm" / "include")
    assert (repo / ".cache" / "deepgemm" / "a.so").exists() and rec.deepgemm == "headers 0.2.0, 1 launchers"
    assert all(env[k] == v for k, v in gpu_env.NO_MULTICAST.items())
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path / "site"), str(repo)]
    assert rec.notes == [".whl was not carried: its packages are missing on this machine"] and rec.wheels == []


def test_cli_lists_suites():
    r = subprocess.run([sys.executable, "-m", "launcher.cli", "bench", "suite", "--list"], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert r.returncode == 0 and all(re.search(rf"^{re.escape(n)}  \[", r.stdout, re.M) for n in SUITES)


def test_step_helper_splits_like_a_shell():
    s = step("x", "{py} -m benchmarks.bench_model --contexts '' --tag t", 10, publish={"a.json": "b.json"})
    assert s.argv == ("{py}", "-m", "benchmarks.bench_model", "--contexts", "", "--tag", "t")
    assert s.publish == (("a.json", "b.json"),)


def test_clock_window_summarises_the_samples_inside_a_span():
    from benchmarks.clock import ClockSampler, parse
    assert parse("1980, 412.35\n") == (1980.0, 412.35) and parse("[N/A], [N/A]") is None
    s = object.__new__(ClockSampler)  # no nvidia-smi here: samples injected
    s.samples, s.slack_s = [(1.0, 1980.0, 400.0), (2.0, 1860.0, 650.0), (3.0, 1970.0, 600.0), (9.0, 345.0, 80.0)], 0.06
    assert s.window(1.5, 3.0) == {"sm_mhz": 1915.0, "sm_mhz_min": 1860.0, "watts": 625.0}
    assert s.window(4.0, 5.0) == {}


def test_a_suite_run_unpacked_into_a_dated_folder_feeds_the_report(tmp_path, monkeypatch):
    """The workflow: run a suite, put its folder under benchmarks/results/DATE/, `tandem bench report`:
    the published JSON appears on the page with its run, suite and command, and in the summary table."""
    from benchmarks import report
    monkeypatch.setattr(gpu_env, "versions", lambda env, repo: {"gpu": "NVIDIA H200"})
    doc = {"env": {"date": "2026-12-09 10:00:00 UTC", "gpu": "NVIDIA H200"}, "world": 1,
           "args": {"preset": "gpt-oss-20b", "attention": "flashinfer", "moe": "deepgemm"},
           "prefill": {"rows": [{"tokens": 8192, "ms": 90.0, "TFLOPs": 600.0, "ratio_fp8_peak": 0.42,
                                 "tokens_per_s_per_gpu": 91000.0, "usd_per_M_input": 0.0092}]},
           "decode": {"rows": [{"context": 8192, "batch": b, "ms_per_step": 3.0 * b ** 0.5, "gpu_ms_graph_replay": 2.5,
                                "tok_s_per_user": 333.0 / b ** 0.5, "tok_s_per_gpu": 333.0 * b ** 0.5,
                                "usd_per_M_output": 2.5 / b ** 0.5, "hbm_floor_ms": 1.0, "ratio_to_floor": 0.33}
                               for b in (1, 32)]}}
    write = ("import json, os, pathlib; (pathlib.Path(os.environ['OUT']) / 'model_t.json').write_text("
             f"{json.dumps(json.dumps(doc))})")
    suite = Suite("x", carry=(), gpu=False, kind="cpu",
                  steps=(Step("m20b", _py(write), 60, publish=(("model_t.json", "model_t.json"),), gpus=0),))
    dated = tmp_path / "2026-12-09"
    rc, rec = suite_run.run_suite("model", suite, dated / "model", "tandem bench suite model", ["model"])
    assert rc == 0 and rec["published"] == {"model_t.json": "m20b/model_t.json"}
    _, text, _, summary, _, _ = report.generate(dated, out=tmp_path / "page", plots=False)
    assert "| `model_t.json` | model (model/) |" in text and "`tandem bench suite model`" in text
    assert summary[2].startswith("| gpt-oss-20b (run model (model/), 2026-12-09) | 90.0 ms")
    assert summary[2].endswith("| not measured |")  # batch 128 was not in the run
