#!/usr/bin/env bash
# Packs what the GPU machine needs to run the DeepGEMM paths into .cache/dgcarry/ (~1.5 MB, so it
# fits beside the 57 MB NIXL wheels in one device call's 64 MiB carry): the sgl-deep-gemm wheel's
# headers + VERSION (xz), and the launchers the default paths load, built here (scripts/gpu/dg_build.py).
# On the GPU machine the suite runner unpacks it (benchmarks/gpu_env.py; for ad-hoc commands scripts/gpu/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
whl=$(ls .whl/sgl_deep_gemm-*.whl 2>/dev/null | head -1 || true)  # none on a fresh machine
[ -n "$whl" ] || bash scripts/fetch_deepgemm_wheel.sh
whl=$(ls .whl/sgl_deep_gemm-*.whl | head -1)
tmp=$(mktemp -d)
python3 -m zipfile -e "$whl" "$tmp"
mkdir -p .cache/dgcarry
tar cJf .cache/dgcarry/headers.tar.xz -C "$tmp" deep_gemm/include deep_gemm/VERSION
# builds only what is missing (seconds when nothing changed; ~15 s per launcher otherwise)
TANDEM_DEEPGEMM_INCLUDE="$tmp/deep_gemm/include" TANDEM_CACHE=$PWD/.cache ${PYTHON:-.venv/bin/python} -m scripts.gpu.dg_build
tar cJf .cache/dgcarry/launchers.tar.xz -C .cache deepgemm
rm -rf "$tmp"
du -ch .cache/dgcarry/* | tail -1
