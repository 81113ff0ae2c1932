#!/usr/bin/env bash
# Idempotent set-up of .venv on a fresh CPU machine. torch==2.13.0 goes first: it is the CPU build
# on local disk; anything unpinned would pull a multi-GB CUDA build. nixl-cu13 plus the `nixl` shim
# with --no-deps avoids pulling both CUDA variants. Re-runs only when these files change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=".venv/.deps-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setting up .venv (first run: a few minutes)..." >&2
  python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install -q nixl-cu13==1.5.1 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install -q --no-deps nixl==1.5.1 2>&1 | grep -v "^WARNING: Location" || true
  python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  python -c "import torch, triton, nixl, openai_harmony, ray, transformers; assert torch.__version__.startswith('2.13.0')"
  rm -f .venv/.deps-*
  touch "$stamp"
fi
# DeepGEMM's kernel headers (the sgl-deep-gemm wheel's include/, 5 MB, no install) where nvcc exists,
# so the CPU tests can compile our SM90 launcher (tests/kernels/test_deepgemm_build.py). Best effort.
HDR=.cache/deepgemm-headers
if command -v nvcc >/dev/null 2>&1 && [ ! -f "$HDR/deep_gemm/VERSION" ]; then
  tmp=$(mktemp -d)
  if python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
       --platform manylinux2014_x86_64 -d "$tmp" sgl-deep-gemm==0.2.0 >/dev/null 2>&1; then
    mkdir -p "$HDR" && python -m zipfile -e "$tmp"/sgl_deep_gemm-*.whl "$tmp/x" \
      && mkdir -p "$HDR/deep_gemm" && cp -r "$tmp/x/deep_gemm/include" "$tmp/x/deep_gemm/VERSION" "$HDR/deep_gemm/"
  else
    echo "note: could not download sgl-deep-gemm headers; the DeepGEMM build test will skip" >&2
  fi
  rm -rf "$tmp"
fi
