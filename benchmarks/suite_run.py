"""`tandem bench suite NAME`: runs one suite of benchmarks/suites.py on this machine.

  1. set-up (GPU suites): carried wheels into /tmp/site, multicast off, FlashInfer and DeepGEMM carries
     (benchmarks/gpu_env.py); the versions the steps will see (torch, triton, CUDA, FlashInfer, GPU);
  2. each step in its own process group with its own timeout (cut to what is left of --budget, so the
     table is always printed inside the device tool's 600 s); a step's background processes (workers)
     start first and are stopped by their process group after it; its log and files go to OUT/STEP/,
     which is also the step's $OUT;
  3. OUT/suite.json (rewritten after every step): suite, the exact command line, git commit and dirty
     flag, date, GPU, versions, set-up, and per step its command, status, seconds, summary line, files
     and the files it publishes to the results report;
  4. `--tar`: OUT packed into OUT.tgz (the device tool returns at most 8 files); then a short table,
     printed last because the device tool returns the output's tail.

    tandem bench suite NAME [--out DIR] [--tar] [--only STEP,..] [--budget S] [--no-setup]
    tandem bench suite --list | NAME --device-call
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks import gpu_env
from benchmarks.suites import SUITES, Step, Suite
from common.errors import ConfigError

RUNNER = "tandem bench suite"  # suite.json's marker: the results report reads such folders' published files
RESERVE_S = 15  # kept back from --budget for suite.json, the tarball and the table
MIN_STEP_S = 10  # a step is not started with less time than this left


def git_state(repo: Path, env: dict[str, str]) -> dict:
    """The commit the run used. The caller's TANDEM_GIT_COMMIT / TANDEM_GIT_DIRTY (which --device-call
    writes into the command) win: the device copy's .git, where there is one, is the session's starting
    clone, not the checkout that was sent (seen 2026-12-02: it named the session's first commit)."""
    if env.get("TANDEM_GIT_COMMIT"):
        return {"commit": env["TANDEM_GIT_COMMIT"], "dirty": env.get("TANDEM_GIT_DIRTY", "1") != "0",
                "source": "TANDEM_GIT_COMMIT (set by the caller)"}
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            st = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=60)
            return {"commit": head.stdout.strip(), "dirty": bool(st.stdout.strip()), "source": "git"}
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    return {"commit": None, "dirty": None, "source": "unknown: no .git and no TANDEM_GIT_COMMIT"}


def _stop(proc: subprocess.Popen, grace_s: float = 5.0) -> int | None:
    """Ends a process we started and everything it started (its own process group), TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
    try:  # the group may outlive its leader (a worker's ranks): end the stragglers too
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.poll()


def _expand(argv: tuple[str, ...], out: Path) -> list[str]:
    return [a.replace("{py}", sys.executable).replace("{out}", str(out)) for a in argv]


def summary_line(log: Path, pattern: str) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    if pattern:
        hits = [x for x in lines if re.search(pattern, x)]
        lines = hits or lines
    return (lines[-1] if lines else "(no output)")[:120]


def run_step(step: Step, root: Path, env: dict[str, str], timeout_s: float, repo: Path) -> dict:
    out = root / step.name
    out.mkdir(parents=True, exist_ok=True)
    senv = {**env, **dict(step.env), "OUT": str(out), **gpu_env.NO_MULTICAST}
    argv = _expand(step.argv, out)
    rec: dict = {"name": step.name, "command": shlex.join(argv), "timeout_s": step.timeout_s,
                 "timeout_used_s": round(timeout_s), "log": f"{step.name}/step.log"}
    bg = {}
    for name, cmd in step.background:
        log = open(out / f"{name}.log", "wb")
        bg[name] = (subprocess.Popen(_expand(cmd, out), stdout=log, stderr=subprocess.STDOUT, env=senv, cwd=repo,
                                     start_new_session=True), _expand(cmd, out), log)
    t0 = time.monotonic()
    with open(out / "step.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=senv, cwd=repo, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            rc = _stop(proc)
            status = f"timeout ({round(timeout_s)} s)"
        _stop(proc)  # leftovers of the step's own group
    rec.update(status=status, rc=rc, seconds=round(time.monotonic() - t0, 1))
    rec["background"] = {}
    for name, (p, cmd, log) in bg.items():
        early = p.poll()
        code = _stop(p)
        log.close()
        rec["background"][name] = {"command": shlex.join(cmd), "log": f"{step.name}/{name}.log",
                                   "exited_early": early is not None, "rc": code}
    rec["summary"] = summary_line(out / "step.log", step.summary)
    if rec["status"] == "ok":
        dead = [n for n, b in rec["background"].items() if b["exited_early"]]
        if dead:
            rec["summary"] = f"background {', '.join(dead)} exited early; " + rec["summary"]
    rec["files"] = sorted(str(p.relative_to(root)) for p in out.rglob("*") if p.is_file())
    rec["published"] = {name: f"{step.name}/{src}" for src, name in step.publish if (out / src).is_file()}
    return rec


def visible_gpus(versions: dict) -> int:
    return int(versions.get("gpus") or len(versions.get("nvidia_smi") or []))


def table(record: dict) -> str:
    v, g = record["versions"], record["git"]
    head = (f"suite {record['suite']} @ {(g['commit'] or 'unknown commit')[:12]}{' (dirty)' if g['dirty'] else ''} · "
            f"{record['gpu']} · torch {v.get('torch')} · triton {v.get('triton')} · CUDA {v.get('cuda')} · "
            f"flashinfer {v.get('flashinfer')}")
    rows = [(s["name"], s["status"], f"{s.get('seconds', 0):.0f}", s.get("summary", "")) for s in record["steps"]]
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("step", "status", "s"))]
    lines = [head, f"{'step':<{w[0]}}  {'status':<{w[1]}}  {'s':>{w[2]}}  summary"]
    lines += [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:>{w[2]}}  {d}" for a, b, c, d in rows]
    ok = sum(s["status"] in ("ok",) or s["status"].startswith("skipped") for s in record["steps"])
    lines.append(f"{ok}/{len(rows)} steps ok or skipped; {record['seconds']:.0f} s; {record['where']}")
    return "\n".join(lines)


def run_suite(name: str, suite: Suite, out: Path, command: str, args: list[str], *, only: set[str] | None = None, setup: bool = True,
              budget_s: float = 0, tar: bool = False, paths: gpu_env.SetupPaths | None = None) -> tuple[int, dict]:
    t_start = time.monotonic()
    deadline = t_start + budget_s if budget_s > 0 else float("inf")
    paths = paths or gpu_env.SetupPaths()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: give a new --out folder")
    out.mkdir(parents=True, exist_ok=True)
    env, rec = gpu_env.setup(suite.carry, gpu=suite.gpu and setup, paths=paths)
    versions = gpu_env.versions(env, paths.repo)
    record = {"runner": RUNNER, "suite": name, "description": suite.description, "kind": suite.kind,
              "carry": list(suite.carry), "command": command, "args": args, "git": git_state(paths.repo, env),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": platform.node(),
              "gpu": versions.get("gpu"), "versions": versions, "setup": rec.as_dict(), "steps": [], "published": {},
              "seconds": 0.0, "where": str(out)}
    gpus = visible_gpus(versions)
    for step in suite.steps:
        left = deadline - time.monotonic() - RESERVE_S
        if only is not None and step.name not in only:
            continue
        if step.gpus > gpus:
            res = {"name": step.name, "status": f"skipped: needs {step.gpus} GPU(s), {gpus} visible", "seconds": 0,
                   "summary": ""}
        elif left < MIN_STEP_S:
            res = {"name": step.name, "status": "not run: --budget spent", "seconds": 0, "summary": ""}
        else:
            print(f"[suite {name}] {step.name}: {shlex.join(_expand(step.argv, out / step.name))}", flush=True)
            res = run_step(step, out, env, min(step.timeout_s, left), paths.repo)
            print(f"[suite {name}] {step.name}: {res['status']} in {res['seconds']:.0f} s", flush=True)
        record["steps"].append(res)
        record["published"].update(res.get("published", {}))
        record["seconds"] = round(time.monotonic() - t_start, 1)
        (out / "suite.json").write_text(json.dumps(record, indent=1) + "\n")
    if tar:
        archive = out.with_name(out.name + ".tgz")
        record["where"] = f"packed into {archive} (unpack into benchmarks/results/DATE/)"
        (out / "suite.json").write_text(json.dumps(record, indent=1) + "\n")
        with tarfile.open(archive, "w:gz") as t:
            t.add(out, arcname=out.name)
        shutil.rmtree(out)
    failed = [s for s in record["steps"] if not (s["status"] == "ok" or s["status"].startswith("skipped"))]
    return (1 if failed else 0), record


def device_call(name: str, suite: Suite, repo: Path = gpu_env.REPO) -> str:
    g = git_state(repo, {})
    cmd = (f"TANDEM_GIT_COMMIT={g['commit'] or 'unknown'} TANDEM_GIT_DIRTY={int(bool(g['dirty']))} "
           f"python3 -m launcher.cli bench suite {name} --out $OUT/{name} --tar")
    lines = [f"run(kind={suite.kind!r}, timeout_s=600, carry={list(suite.carry)!r},",
             f"    command={cmd!r})"]
    missing = [c for c in suite.carry if not (repo / c).exists()]
    sizes = {c: _size(repo / c) for c in suite.carry if (repo / c).exists()}
    if sizes:
        total = sum(sizes.values())
        lines.append(f"# carried: {', '.join(f'{c} {b / 2**20:.1f} MiB' for c, b in sizes.items())}; the call takes "
                     f"64 MiB with the working tree{' -- too much' if total > 60 * 2**20 else ''}")
    if missing:
        lines.append(f"# missing here (fetch or pack them first, see benchmarks/suites.py): {', '.join(missing)}")
    if g["dirty"]:
        lines.append("# the checkout is dirty: commit first so the run names a commit that holds what ran")
    return "\n".join(lines)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_suites(suites: dict[str, Suite]) -> str:
    out = []
    for name, s in suites.items():
        out.append(f"{name}  [{s.kind}; steps {s.total_timeout_s()} s of {s.budget_s}; carry {list(s.carry)}]")
        out.append(f"  {s.description}")
        out += [f"  - {st.name} ({st.timeout_s} s): {' '.join(st.argv)}" for st in s.steps]
        out += [f"  reproduces {r}" for r in s.reproduces]
    return "\n".join(out)


def main(argv: list[str] | None = None, suites: dict[str, Suite] | None = None) -> int:
    suites = SUITES if suites is None else suites
    p = argparse.ArgumentParser(prog="tandem bench suite", description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", help="one of: " + ", ".join(suites))
    p.add_argument("--out", type=Path, help="output folder (default $OUT/NAME, else out/suites/NAME-DATE)")
    p.add_argument("--tar", action="store_true", help="pack the output folder into OUT.tgz (for the device tool)")
    p.add_argument("--only", help="comma-separated step names")
    p.add_argument("--budget", type=float, default=590, help="seconds for the whole suite, 0 = none (default 590: "
                   "the device tool stops a command at 600 s)")
    p.add_argument("--no-setup", action="store_true", help="skip the GPU set-up (wheels, carries)")
    p.add_argument("--list", action="store_true", help="list the suites")
    p.add_argument("--device-call", action="store_true", help="print the device-tool call that runs NAME")
    a = p.parse_args(argv)
    if a.list or not a.name:
        print(list_suites(suites))
        return 0 if a.list else 2
    if a.name not in suites:
        raise ConfigError(f"unknown suite {a.name!r}; suites: {', '.join(suites)}")
    suite = suites[a.name]
    if a.device_call:
        print(device_call(a.name, suite))
        return 0
    only = set(a.only.split(",")) if a.only else None
    if only and only - {s.name for s in suite.steps}:
        raise ConfigError(f"suite {a.name} has no step(s) {sorted(only - {s.name for s in suite.steps})}")
    out = a.out or (Path(os.environ["OUT"]) / a.name if os.environ.get("OUT") else
                    Path("out/suites") / f"{a.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    command = shlex.join(getattr(sys, "orig_argv", sys.argv))  # as typed, interpreter included
    args = list(sys.argv[1:] if argv is None else argv)
    rc, record = run_suite(a.name, suite, out, command, args, only=only, setup=not a.no_setup, budget_s=a.budget, tar=a.tar)
    print(table(record), flush=True)
    return rc
