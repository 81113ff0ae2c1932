"""FlashInfer's JIT-built attention-sink modules carried between GPU runs (a fresh device machine would
spend minutes rebuilding them): saved from one run's $OUT, restored into FlashInfer's AOT folder by
the next (FLASHINFER_CACHE_TAR), where FlashInfer loads them without invoking ninja."""

from __future__ import annotations

import glob
import os
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
    tmp = "/tmp/fi-cache-save.tar.xz"
    with tarfile.open(tmp, "w:xz") as tar:
        for so in sos:
            tar.add(so, arcname=os.path.relpath(so, env.FLASHINFER_JIT_DIR))
    blob = open(tmp, "rb").read()
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


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="save this machine's built FlashInfer sink modules")
    ap.add_argument("--save", required=True, help="folder for flashinfer-cache.tar.xz (parts when large)")
    a = ap.parse_args()
    os.makedirs(a.save, exist_ok=True)
    print(json.dumps(save_cache(a.save)))
