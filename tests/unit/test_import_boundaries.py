"""The house's one-way dependencies, checked on the source (AST), so a new import that crosses a
boundary fails CI: nothing below the router imports `router`; the roles (prefill_worker,
decode_worker, router) do not import each other; the wire imports no role and no torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BELOW_ROUTER = ("prefill_worker", "decode_worker", "engine", "kv_transfer", "model", "kernels", "common", "wire")
ROLES = ("prefill_worker", "decode_worker", "router")


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a module imports, lazily imported ones (inside functions) included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def modules(pkg: str) -> list[Path]:
    return sorted((ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg", BELOW_ROUTER)
def test_nothing_below_the_router_imports_it(pkg):
    bad = [str(p.relative_to(ROOT)) for p in modules(pkg) if "router" in imported_packages(p)]
    assert not bad, f"these import router: {bad}"


@pytest.mark.parametrize("role", ROLES)
def test_roles_do_not_import_each_other(role):
    others = set(ROLES) - {role}
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & others) for p in modules(role)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{role} imports another role: {bad}"


def test_the_wire_imports_no_role_and_no_torch():
    allowed = {"__future__", "dataclasses", "types", "typing", "msgpack", "common", "wire"}
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) - allowed) for p in modules("wire")}
    assert not any(bad.values()), bad
