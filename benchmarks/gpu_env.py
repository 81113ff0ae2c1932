"""The GPU machine's set-up before a suite runs (what `scripts/gpu/env.sh` did by hand in every dated
run script): the carried wheels installed into /tmp/site, NVLink multicast kept off, FlashInfer's
carried JIT modules restored, DeepGEMM's carried headers and launchers unpacked.

The device machine starts bare and cannot reach a package registry, so what a run needs travels in
git-ignored folders named in the device call's `carry` (see benchmarks/suites.py):
  .whl/           FlashInfer + DeepGEMM wheels   (scripts/fetch_gpu_wheels.sh, fetch_deepgemm_wheel.sh)
  .whl-nixl/      NIXL + pyzmq wheels            (scripts/fetch_nixl_wheel.sh)
  .cache/fi/      FlashInfer's built sink modules (flashinfer-cache.tar.xz from an attention run's output,
                  or built ahead without a GPU: python -m benchmarks.flashinfer_cache --prebuild)
  .cache/dgcarry/ DeepGEMM headers + launchers   (scripts/pack_deepgemm_carry.sh)
  .whl-site/      site.tar.xz: everything the whole served stack needs, installed and slimmed
                  (FlashInfer, the router's packages, NIXL without its unused plugins; fits 64 MiB
                  with the rest: `python -m benchmarks.gpu_carry`)

`setup()` returns the environment every step runs with (this process's, plus the above) and a record
of what it did. `python -m benchmarks.gpu_env --shell` prints the same set-up as `export` lines for
an ad-hoc device command (scripts/gpu/env.sh evaluates them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# NVLink multicast must stay off on the lent machines (a program using it can take the host's shared
# GPUs out of service): every step inherits these and no step may change them.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WHEEL_DIRS = (".whl", ".whl-nixl")
SITE_TAR = ".whl-site/site.tar.xz"
FLASHINFER_TAR = ".cache/fi/flashinfer-cache.tar.xz"
DG_CARRY = ".cache/dgcarry"


@dataclass(slots=True)
class SetupPaths:
    repo: Path = REPO
    site: Path = Path("/tmp/site")  # carried wheels are installed here (--target)
    dg_root: Path = Path("/tmp/dg")  # DeepGEMM headers unpack here
    flashinfer_workspace: Path = Path("/tmp/tandem-flashinfer")


@dataclass(slots=True)
class SetupRecord:
    wheels: list[str] = field(default_factory=list)
    flashinfer_modules: int | None = None
    deepgemm: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"wheels": self.wheels, "flashinfer_modules_restored": self.flashinfer_modules,
                "deepgemm_carry": self.deepgemm, "notes": self.notes}


def base_env(paths: SetupPaths, gpu: bool) -> dict[str, str]:
    """The environment of every step: the repository (and /tmp/site on a GPU machine) first on the path,
    unbuffered output, multicast off."""
    env = dict(os.environ)
    path = [str(paths.site)] if gpu else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(paths.repo), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(NO_MULTICAST)
    if gpu:
        env["FLASHINFER_WORKSPACE_BASE"] = str(paths.flashinfer_workspace)
        torch_spec = importlib.util.find_spec("torch")
        if torch_spec and torch_spec.origin:  # the sgl-deep-gemm / NIXL libraries link against torch's
            lib = str(Path(torch_spec.origin).parent / "lib")
            env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def unpack_site(paths: SetupPaths, carry: tuple[str, ...], rec: SetupRecord) -> None:
    """A pre-installed, slimmed site-packages (benchmarks/gpu_carry.py) unpacked into /tmp/site."""
    tar = paths.repo / SITE_TAR
    if ".whl-site" not in carry or not tar.exists():
        return
    paths.site.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["tar", "xJf", str(tar), "-C", str(paths.site)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        rec.notes.append(f"{SITE_TAR} did not unpack: {r.stderr.strip()[-300:]}")
        return
    rec.wheels.append(f"{SITE_TAR} ({sum(1 for p in paths.site.glob('*.dist-info'))} packages)")


def install_wheels(paths: SetupPaths, carry: tuple[str, ...], rec: SetupRecord) -> None:
    wheels = sorted(str(w) for d in carry if d in WHEEL_DIRS for w in (paths.repo / d).glob("*.whl"))
    for d in carry:
        if d in WHEEL_DIRS and not (paths.repo / d).is_dir():
            rec.notes.append(f"{d} was not carried: its packages are missing on this machine")
    if not wheels:
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(paths.site), *wheels]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        rec.notes.append(f"pip install of the carried wheels failed: {(r.stderr or r.stdout).strip()[-300:]}")
        return
    rec.wheels += [Path(w).name for w in wheels]


def restore_flashinfer(paths: SetupPaths, env: dict[str, str], rec: SetupRecord) -> None:
    """FlashInfer's sink modules built on an earlier machine, restored as AOT modules (no JIT rebuild).
    In a child process: FlashInfer imports from /tmp/site, which this process does not have on its path."""
    tar = paths.repo / FLASHINFER_TAR
    if not tar.exists() and not list(tar.parent.glob(tar.name + ".part*")):
        return
    code = "from benchmarks.flashinfer_cache import restore_cache; print(restore_cache())"
    r = subprocess.run([sys.executable, "-c", code], env={**env, "FLASHINFER_CACHE_TAR": str(tar)}, cwd=paths.repo,
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0 and r.stdout.strip().isdigit():
        rec.flashinfer_modules = int(r.stdout.strip())
    else:
        rec.notes.append(f"{FLASHINFER_TAR} not restored: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


def unpack_deepgemm(paths: SetupPaths, env: dict[str, str], rec: SetupRecord) -> None:
    """The sgl-deep-gemm headers our launchers compile against, and the launchers built on the CPU
    machine (TANDEM_CACHE/deepgemm), so no worker builds one at start-up."""
    carry = paths.repo / DG_CARRY
    if not (carry / "headers.tar.xz").exists():
        return
    paths.dg_root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(carry / "headers.tar.xz") as t:
        t.extractall(paths.dg_root, filter="data")
    cache = paths.repo / ".cache"
    if (carry / "launchers.tar.xz").exists():
        with tarfile.open(carry / "launchers.tar.xz") as t:
            t.extractall(cache, filter="data")
    env["TANDEM_DEEPGEMM_INCLUDE"] = str(paths.dg_root / "deep_gemm" / "include")
    env["TANDEM_CACHE"] = str(cache)
    version = paths.dg_root / "deep_gemm" / "VERSION"
    launchers = len(list((cache / "deepgemm").glob("*"))) if (cache / "deepgemm").is_dir() else 0
    rec.deepgemm = f"headers {version.read_text().strip() if version.exists() else '?'}, {launchers} launchers"


def setup(carry: tuple[str, ...], gpu: bool, paths: SetupPaths | None = None) -> tuple[dict[str, str], SetupRecord]:
    paths = paths or SetupPaths()
    rec = SetupRecord()
    if gpu:
        unpack_site(paths, carry, rec)
        install_wheels(paths, carry, rec)
    env = base_env(paths, gpu)
    if gpu:
        restore_flashinfer(paths, env, rec)
        unpack_deepgemm(paths, env, rec)
    return env, rec


VERSIONS = r"""
import json, platform
out = {"python": platform.python_version()}
for name, mod in (("torch", "torch"), ("triton", "triton"), ("flashinfer", "flashinfer"), ("nixl", "nixl")):
    try:
        out[name] = __import__(mod).__version__
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out[name] = None
try:
    import torch
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
except Exception:  # noqa: BLE001
    pass
print(json.dumps(out))
"""


def versions(env: dict[str, str], cwd: Path = REPO) -> dict:
    """torch / triton / CUDA / FlashInfer / NIXL as the steps will see them, the GPU name and driver."""
    out: dict = {}
    try:
        r = subprocess.run([sys.executable, "-c", VERSIONS], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=180)
        out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
    except (subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if smi.returncode == 0:
            out["nvidia_smi"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    out.setdefault("gpu", (out.get("nvidia_smi") or ["none (no NVIDIA GPU visible)"])[0].split(",")[0])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_env", description=__doc__.split("\n\n")[0])
    p.add_argument("--carry", nargs="*", default=[".whl-site", ".whl", ".whl-nixl", ".cache/fi", DG_CARRY],
                   help="carried folders to set up from (those absent are skipped)")
    p.add_argument("--shell", action="store_true", help="print `export` lines for a shell to eval")
    a = p.parse_args(argv)
    before = dict(os.environ)
    env, rec = setup(tuple(a.carry), gpu=True)
    for line in rec.notes:
        print(f"echo {shlex.quote('gpu_env: ' + line)} >&2")
    changed = {k: v for k, v in env.items() if before.get(k) != v}
    if a.shell:
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(changed.items())))
        print(f"echo {shlex.quote('gpu_env: ' + json.dumps(rec.as_dict()))} >&2")
    else:
        print(json.dumps({"env": changed, **rec.as_dict()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
