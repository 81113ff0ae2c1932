"""The house rules for GPU runs and their results: scripts/ stays small (GPU runs are suites,
benchmarks/suites.py); every committed result folder names, in its suite.json, the suite (or dated
script) and command of each run with the commit it ran at, and every file in it belongs to a run;
run notes are named by date and run."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
SCRIPT_DIRS = {"runs"}  # a dated folder's run scripts (the runs themselves are in its suite.json)
NOTE = re.compile(r"\d{4}-\d\d-\d\d-runs-[A-Za-z0-9-]+\.md")


def result_folders() -> list[Path]:
    dated = [p for p in RESULTS.iterdir() if p.is_dir()]
    return sorted(dated + [q for p in dated for q in p.iterdir() if q.is_dir() and q.name not in SCRIPT_DIRS])


def _git_has(commit: str) -> bool | None:
    r = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return None if not (REPO / ".git").exists() else r.returncode == 0


def test_scripts_folder_holds_at_most_15_files():
    files = [p for p in (REPO / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len(files) <= 15, sorted(str(p.relative_to(REPO)) for p in files)


GENERATED = ("README.md", "*.png")


def _only_generated(folder: Path) -> bool:
    return all(any(fnmatch.fnmatch(p.name, g) for g in GENERATED) for p in folder.iterdir() if p.is_file())


@pytest.mark.parametrize("folder", result_folders(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_result_folder_names_suite_command_and_commit(folder: Path):
    if not (folder / "suite.json").exists() and folder.parent == RESULTS and _only_generated(folder):
        return  # a dated folder of suite runs only: each sub-folder has its suite.json
    doc = json.loads((folder / "suite.json").read_text())
    if doc.get("runner") == "tandem bench suite":  # written by benchmarks/suite_run.py
        runs = [{"run": doc["suite"], "suite": doc["suite"], "command": doc["command"],
                 "commit": doc["git"]["commit"]}]
    else:
        runs = doc["runs"]
    assert runs
    for r in runs:
        assert r["suite"] and r["command"], r
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"] or ""), r
        if _git_has(r["commit"]) is False:
            pytest.fail(f"{folder.name}: run {r['run']}: commit {r['commit']} is not in the history")
        for rel in [r.get("script")] + [d["script"] for d in r.get("diagnostics", [])]:
            if rel:
                assert (folder / rel).is_file(), f"{folder}: {rel} missing"


@pytest.mark.parametrize("folder", [p for p in RESULTS.iterdir() if p.is_dir()], ids=lambda p: p.name)
def test_every_file_of_a_dated_folder_belongs_to_a_run(folder: Path):
    if not (folder / "suite.json").exists():
        assert _only_generated(folder), f"{folder.name}: result files need a suite.json naming their runs"
        return
    doc = json.loads((folder / "suite.json").read_text())
    patterns = [f for r in doc["runs"] for f in r.get("files", [])] + doc.get("generated", []) + doc.get("notes", [])
    patterns += ["suite.json"]
    loose = [p.name for p in folder.iterdir() if p.is_file() and not any(fnmatch.fnmatch(p.name, x) for x in patterns)]
    assert not loose, f"{folder.name}: files no run claims: {loose}"
    for note in doc.get("notes", []):
        assert NOTE.fullmatch(note) and (folder / note).is_file(), note


def test_notes_are_named_by_date_and_run():
    period = [p for p in RESULTS.rglob("*.md") if re.search(r"session", p.name, re.I) or p.name.startswith("RUNS-")]
    assert not period, period
    assert not list(REPO.glob("README.md")) or "RUNS-session" not in (REPO / "README.md").read_text()
