#!/usr/bin/env bash
# Downloads the wheels the H200 machine lacks for the FlashInfer attention backend and structured
# outputs (llguidance, common/grammar.py; an abi3 wheel tagged manylinux_2_31) into .whl/
# (git-ignored), for python 3.12 manylinux x86_64. No dependencies are resolved (--no-deps): the
# GPU image already has torch, numpy, ninja, einops, click, tabulate, ... (device KINDS.md).
#
# On the GPU machine (carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PIP="${PYTHON:-python3} -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl"
# flashinfer 0.6.6 needs apache-tvm-ffi >=0.1.6,<0.2, not 0.1.8; nvidia-cudnn-frontend >=1.13 is
# imported at module load. Its other dependencies (nvidia-cutlass-dsl, ...) are not needed for
# the attention path (GPU.md).
# llguidance 1.9.1 (3.1 MB, no dependencies) rather than xgrammar: xgrammar 0.2.8 needs apache-tvm-ffi
# >= 0.1.11, and this carry pins 0.1.9 for FlashInfer and DeepGEMM.
WHEELS=(flashinfer-python==0.6.6 apache-tvm-ffi==0.1.9 nvidia-cudnn-frontend==1.16.0 llguidance==1.9.1)
for w in "${WHEELS[@]}"; do
  $PIP "$w"
done
# Keep exactly one version of each package (two versions stop the install on the GPU machine).
for name in flashinfer_python apache_tvm_ffi nvidia_cudnn_frontend llguidance; do
  n=$(ls .whl/${name}-*.whl 2>/dev/null | wc -l)
  if [ "$n" -ne 1 ]; then echo "expected one ${name} wheel in .whl, found $n" >&2; exit 1; fi
done
du -ch .whl/*.whl | tail -1
