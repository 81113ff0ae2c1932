"""Reading the committed results for the report: the dated folders, their JSON, and what produced
each file (the folder's suite.json).

A dated folder holds JSON at its top level, plus folders written by `tandem bench suite` (their
suite.json says runner "tandem bench suite"), whose steps publish files under the names the report
reads (e.g. gemm.json -> kernels_gemm.json). Older runs' folders carry a suite.json that names each
run's script, command and commit (benchmarks/results/*/suite.json, runner "dated run scripts").
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError

SUITE_RUNNER = "tandem bench suite"  # benchmarks/suite_run.py RUNNER (not imported: that pulls the runner in)


@dataclass(frozen=True, slots=True)
class Run:
    """What produced a results file: a run of a suite (or of a dated script before the suites)."""

    run: str  # "DG10", "kernels (2026-12-03/kernels)"
    suite: str
    command: str
    commit: str | None
    where: str  # folder of the run's record, relative to the results root
    date: str = ""
    script: str | None = None  # the run's script as kept in the results folder (dated runs)


def dated_folders(root: Path) -> list[Path]:
    """Dated result folders, newest first."""
    dated = sorted((p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"\d{4}-\d{2}-\d{2}", p.name)),
                   reverse=True)
    if not dated:
        raise ConfigError(f"no dated results folder under {root}")
    return dated


def _read(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not JSON ({e})") from None


def suite_folders(folder: Path) -> list[Path]:
    """Sub-folders written by the suite runner, by the date their suite.json records."""
    subs = [p for p in folder.iterdir() if p.is_dir() and (p / "suite.json").is_file()
            and _read(p / "suite.json").get("runner") == SUITE_RUNNER]
    return sorted(subs, key=lambda p: (_read(p / "suite.json").get("date", ""), p.name))


def load(folder: Path) -> dict[str, dict]:
    """The folder's results by the name the report reads them by: its top-level JSON (suite.json aside)
    and what its suite-run sub-folders publish."""
    docs = {p.name: _read(p) for p in sorted(folder.glob("*.json")) if p.name != "suite.json"}
    subs = suite_folders(folder)
    for sub in subs:
        for name, rel in _read(sub / "suite.json").get("published", {}).items():
            if name in docs:
                raise ConfigError(f"{folder}: {name} is published by {sub.name}/ and exists already; rename one")
            docs[name] = _read(sub / rel)
    if not docs and not subs:  # suite runs that publish nothing (multi-turn A/Bs) still make a dated page
        raise ConfigError(f"no JSON results in {folder}")
    return docs


def runs_of(folder: Path, root: Path) -> dict[str, Run]:
    """File name (as load() names it) -> the run that produced it, from the folder's suite.json files."""
    out: dict[str, Run] = {}
    rel = str(folder.relative_to(root)) if folder.is_relative_to(root) else folder.name
    top = folder / "suite.json"
    if top.is_file():
        doc = _read(top)
        names = [p.name for p in folder.iterdir() if p.is_file()]
        for r in doc.get("runs", []):
            run = Run(r["run"], r["suite"], r["command"], r.get("commit"), rel, script=r.get("script"))
            for pattern in r.get("files", []):
                for n in fnmatch.filter(names, pattern):
                    out.setdefault(n, run)
    for sub in suite_folders(folder):
        doc = _read(sub / "suite.json")
        run = Run(f"{doc['suite']} ({sub.name}/)", doc["suite"], doc["command"], (doc.get("git") or {}).get("commit"),
                  f"{rel}/{sub.name}", doc.get("date", ""))
        for name in doc.get("published", {}):
            out[name] = run
    return out


def load_merged(folders: list[Path], label_of, is_model) -> tuple[dict[str, dict], dict[str, str]]:
    """folders newest first -> (docs, folder name of each file). An older folder's file is left out when
    a newer folder has a file of that name, or a model run of the same configuration (label_of): the
    page shows the latest of every kind of result, and the older ones only where nothing replaced them."""
    docs: dict[str, dict] = {}
    origin: dict[str, str] = {}
    labels: set[str] = set()
    for folder in folders:
        seen_here = set()
        for name, d in load(folder).items():
            label = label_of(d)[0] if is_model(d) else None
            if name in docs or label in labels:
                continue
            docs[name], origin[name] = d, folder.name
            if label is not None:
                seen_here.add(label)
        labels |= seen_here  # added after the folder: its own reruns of one configuration all stay
    return docs, origin
