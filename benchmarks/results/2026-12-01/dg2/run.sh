#!/usr/bin/env bash
# GPU run DG2 (one H200): DeepGEMM-backed dense linear and prefill MoE vs cuBLASLt / Triton MoE, the
# grouped down tiles, then the GEMM/MoE GPU tests (incl. the new DeepGEMM ones). Launchers prebuilt
# on the CPU machine (scripts/gpu/diag_dg2.py --build-only), carried as .cache/deepgemm.
source scripts/gpu/env.sh
export TANDEM_CACHE=$PWD/.cache
mkdir -p $OUT/dg2
timeout 300 python3 -m scripts.gpu.diag_dg2 > $OUT/dg2/diag_dg2.log 2>&1; echo "diag rc=$?"
cut -c1-180 $OUT/dg2/diag_dg2.log | head -70
timeout 240 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -x > $OUT/dg2/gemm_moe_gpu.log 2>&1; echo "tests rc=$?"
tail -25 $OUT/dg2/gemm_moe_gpu.log | cut -c1-300
