"""FlashInfer's JIT-built attention-sink modules carried between GPU runs (a fresh device machine would
spend minutes rebuilding them): saved from one run's $OUT, or built ahead on a machine with nvcc and
no GPU (`--prebuild`), restored into FlashInfer's AOT folder by the next run (FLASHINFER_CACHE_TAR),
where FlashInfer loads them without invoking ninja.

FlashInfer loads an AOT module by its uri alone (<package>/data/aot/<uri>/<uri>.so): no hash of
sources or flags is checked, so a carried .so must come from the same FlashInfer (0.6.6), tvm-ffi and
CUDA major as the GPU's, and a uri must name its sources (the FP8-KV uris end in a hash of our
declaration: kernels/flashinfer_backend.py).

    # here, in a Python 3.12 environment with torch and the GPU's site (/tmp/site: flashinfer 0.6.6,
    # tvm-ffi 0.1.9) importable, CUDA 13 nvcc on PATH:
    python -m benchmarks.flashinfer_cache --prebuild .cache/fi --base .cache/fi/flashinfer-cache.tar.xz

A toolkit without cuRAND's headers (the CPU machine's CUDA 13) fails the fa3 modules on
curand_kernel.h (CUTLASS's utilities include it): copy include/curand*.h of the `nvidia-curand` 10.4
wheel into a folder on the build's include path (/usr/local/include there). Python 3.11 with
flashinfer's cp311 tvm-ffi wheel builds the same modules (they link libtvm_ffi, not libpython).
"""

from __future__ import annotations

import glob
import os
import subprocess
import tarfile


def restore_cache() -> int:
    """Unpack .so files saved by an earlier run as AOT modules: FlashInfer loads
    <package>/data/aot/<uri>/<uri>.so without invoking ninja."""
    src = os.environ.get("FLASHINFER_CACHE_TAR")
    if not src:
        return 0
    from flashinfer.jit import env
    parts = sorted(glob.glob(src + ".part*")) or [src]
    blob = b"".join(open(p, "rb").read() for p in parts)
    tmp = "/tmp/fi-cache-restore.tar.xz"
    with open(tmp, "wb") as f:
        f.write(blob)
    with tarfile.open(tmp) as tar:
        names = [m for m in tar.getmembers() if m.name.endswith(".so")]
        tar.extractall(env.FLASHINFER_AOT_DIR, members=names, filter="data")
    return len(names)


def save_cache(out_dir: str) -> dict | None:
    """The sink variants built in this run as <out_dir>/flashinfer-cache.tar.xz (split in 15 MiB parts
    when larger), for FLASHINFER_CACHE_TAR in a later run; returns what was saved."""
    from flashinfer.jit import env
    sos = sorted(glob.glob(str(env.FLASHINFER_JIT_DIR / "tandem_attention_sink_*" / "*.so")))
    if not sos:
        return None
    return write_tar({os.path.relpath(so, env.FLASHINFER_JIT_DIR): so for so in sos}, out_dir)


def write_tar(members: dict[str, str], out_dir: str) -> dict:
    """<uri>/<uri>.so -> file, as <out_dir>/flashinfer-cache.tar.xz (parts when large)."""
    tmp = "/tmp/fi-cache-save.tar.xz"
    with tarfile.open(tmp, "w:xz") as tar:
        for arcname, path in sorted(members.items()):
            tar.add(path, arcname=arcname)
    blob = open(tmp, "rb").read()
    sos = list(members)
    chunk = 15 << 20
    meta = {"modules": len(sos), "bytes": len(blob)}
    if len(blob) > 4 * chunk:  # $OUT returns at most 8 files of 16 MiB, 64 MiB together
        return {**meta, "skipped": "too large to come back"}
    name = os.path.join(out_dir, "flashinfer-cache.tar.xz")
    if len(blob) <= chunk:
        open(name, "wb").write(blob)
    else:
        for i in range(0, len(blob), chunk):
            open(f"{name}.part{i // chunk}", "wb").write(blob[i:i + chunk])
    return meta


def gpt_oss_variants() -> list[tuple]:
    """(backend, dtype, head_dim, sliding, kv_dtype) of every module FlashInferAttention builds for
    gpt-oss (bf16, head_dim 64, sliding and full layers): bf16 pages read by fa2 (decode) and fa3
    (prefill), e4m3 pages read by fa2 (FP8-KV decode)."""
    import torch
    from kernels.flashinfer_fp8kv import FP8_KV
    bf16 = [(b, torch.bfloat16, 64, s, None) for b in ("fa2", "fa3") for s in (False, True)]
    return bf16 + [("fa2", torch.bfloat16, 64, s, FP8_KV) for s in (False, True)]


def _link_without_driver() -> None:
    """FlashInfer links every module with -lcuda, found on a machine without a driver in the toolkit's
    lib64/stubs. A toolkit without that stub (this CPU machine's CUDA 13) gets an empty libcuda.so:
    the modules call only the runtime API (libcudart), and --as-needed keeps libcuda out of their
    NEEDED entries, as in the modules built on the H200."""
    from flashinfer.jit.cpp_ext import get_cuda_path
    cuda = get_cuda_path()
    # FlashInfer links with -L<cuda>/lib64 -lcudart; some toolkits (this CPU machine's) keep it in lib/
    found = [os.path.join(root, sub) for root in (cuda, "/usr/local/cuda") for sub in ("lib64", "lib")
             if os.path.exists(os.path.join(root, sub, "libcudart.so"))]
    if found:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{found[0]} " + os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
    if os.path.exists(os.path.join(cuda, "lib64", "stubs", "libcuda.so")):
        return
    stub = "/tmp/fi-prebuild-stub"
    os.makedirs(stub, exist_ok=True)
    subprocess.run(["cc", "-shared", "-x", "c", "/dev/null", "-o", f"{stub}/libcuda.so", "-Wl,-soname,libcuda.so.1"],
                   check=True)
    os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"-L{stub} " + os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
    os.environ["CXX"] = os.environ.get("CXX", "c++") + " -Wl,--as-needed"  # the link rule's $cxx


def prebuild(out_dir: str, base: str | None) -> dict:
    """Build, for sm_90a on this machine (no GPU needed: nvcc only), every gpt-oss module that the
    `base` tarball lacks, and write base's modules and these as <out_dir>/flashinfer-cache.tar.xz."""
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")  # read when flashinfer is imported
    from kernels.flashinfer_variants import variant_spec
    _link_without_driver()
    members, kept = {}, []
    tmp = "/tmp/fi-cache-base"
    if base:
        with tarfile.open(base) as tar:
            sos = [m for m in tar.getmembers() if m.name.endswith(".so")]
            tar.extractall(tmp, members=sos, filter="data")
        members = {m.name: os.path.join(tmp, m.name) for m in sos}
        kept = sorted(members)
    built = []
    for args in gpt_oss_variants():
        spec = variant_spec(*args)
        arcname = f"{spec.name}/{spec.name}.so"
        if arcname in members:
            continue
        spec.write_ninja()  # FlashInfer's build() keeps an existing build.ninja, flags and all
        spec.build(verbose=True)  # ninja + nvcc; nothing is loaded (that needs a driver)
        members[arcname] = str(spec.jit_library_path)
        built.append(arcname)
    os.makedirs(out_dir, exist_ok=True)
    return {**write_tar(members, out_dir), "kept": kept, "built": built}


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="save this machine's built FlashInfer sink modules, or build "
                                             "gpt-oss's ahead on a machine without a GPU")
    ap.add_argument("--save", help="folder for flashinfer-cache.tar.xz (parts when large)")
    ap.add_argument("--prebuild", help="folder for flashinfer-cache.tar.xz: the modules --base lacks, built here")
    ap.add_argument("--base", help="a flashinfer-cache.tar.xz whose modules are kept (with --prebuild)")
    a = ap.parse_args()
    if bool(a.save) == bool(a.prebuild):
        ap.error("one of --save, --prebuild")
    if a.prebuild:
        print(json.dumps(prebuild(a.prebuild, a.base)))
    else:
        os.makedirs(a.save, exist_ok=True)
        print(json.dumps(save_cache(a.save)))
