"""House rules that a test can hold: file size, and the direction of imports between packages."""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 800  # STYLE.md: aim for 400, fail above 800


def _py_files():
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / p for p in out.split()]


def test_no_python_file_over_the_limit():
    big = [(p.relative_to(ROOT), n) for p in _py_files() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"split these by role: {big}"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module.split(".")[0])
    return mods


def test_import_direction():
    """kernels <- model <- engine <- workers; the router and common never import torch-side packages."""
    forbidden = {
        "kernels": {"model", "engine", "prefill_worker", "decode_worker", "router", "launcher"},
        "model": {"engine", "prefill_worker", "decode_worker", "router", "launcher"},
        "router": {"torch", "model", "kernels", "engine", "prefill_worker", "decode_worker", "kv_transfer"},
        "common": {"torch", "model", "kernels", "prefill_worker", "decode_worker", "launcher"},
        "kv_transfer": {"engine", "prefill_worker", "decode_worker", "router", "launcher"},
    }
    bad = []
    for p in _py_files():
        pkg = p.relative_to(ROOT).parts[0]
        if pkg in forbidden:
            hit = _imports(p) & forbidden[pkg]
            if hit:
                bad.append((str(p.relative_to(ROOT)), sorted(hit)))
    assert not bad, bad
