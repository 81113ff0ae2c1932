#!/usr/bin/env bash
# Downloads a DeepGEMM wheel (SGLang's fork, `sgl-deep-gemm`) for the H200 machine into .whl/
# (git-ignored), python 3.12 manylinux x86_64, no dependency resolution.
#
# Why 0.2.0: 0.2.5 fails to load against the GPU machine's torch 2.11 with `undefined symbol
# c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture()` (GPU.md). Inspecting the published
# wheels' _C.so (`nm -D --undefined-only`): 0.2.1.post1 and every later release reference that
# symbol; 0.2.0 (2026-09-14) and earlier reference only the long-standing 5-argument
# `c10_cuda_check_implementation`, and every non-CUDA torch symbol 0.2.0 needs is defined by torch
# 2.13's CPU libraries. 0.2.0 is therefore the newest release that may load; the GPU script checks.
# It loads through apache-tvm-ffi (its METADATA pins 0.1.11); the 6 TVM-FFI symbols its _C.so
# imports are all exported by 0.1.9, which the FlashInfer wheels already carry
# (scripts/fetch_gpu_wheels.sh), so one tvm-ffi version serves both (two versions stop the install).
#
# On the GPU machine (carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
#   export LD_LIBRARY_PATH=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib:$LD_LIBRARY_PATH
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
VERSION="${DEEPGEMM_VERSION:-0.2.0}"
PIP="${PYTHON:-python3} -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl"
rm -f .whl/sgl_deep_gemm-*.whl
$PIP "sgl-deep-gemm==${VERSION}"
if ! ls .whl/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  $PIP "apache-tvm-ffi==0.1.9"
fi
whl=$(ls .whl/sgl_deep_gemm-*.whl)
size=$(stat -c %s "$whl")
if [ "$size" -gt $((8 * 1024 * 1024)) ]; then echo "$whl is $size bytes (> 8 MB)" >&2; exit 1; fi
# Report what the wheel's extension imports from torch's CUDA side (the symbol that broke 0.2.5).
if command -v nm >/dev/null; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && unzip -qo "$OLDPWD/$whl" 'deep_gemm/_C.so')
  if nm -D --undefined-only "$tmp/deep_gemm/_C.so" | grep -q CUDAErrorLogCapture; then
    echo "warning: $whl references c10::cuda::CUDAErrorLogCapture (needs torch newer than 2.11)" >&2
  fi
fi
for name in sgl_deep_gemm apache_tvm_ffi; do
  n=$(ls .whl/${name}-*.whl 2>/dev/null | wc -l)
  if [ "$n" -ne 1 ]; then echo "expected one ${name} wheel in .whl, found $n" >&2; exit 1; fi
done
ls -la "$whl"
du -ch .whl/*.whl | tail -1
