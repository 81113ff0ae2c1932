#!/usr/bin/env bash
# GPU run DG13 (one H200, session 9): the O projection's bias in DeepGEMM's K: compiled-in N/K vs
# runtime, 128-byte vs 16-byte aligned rows, the bias block stored whole (scripts/gpu/diag_dg13.py),
# after the DeepGEMM GPU tests on the changed launcher source. Carry [".whl", ".cache/dgcarry"].
source scripts/gpu/env.sh
source scripts/gpu/dg_unpack.sh
D=$OUT/dg13; mkdir -p $D
timeout 200 python3 -m pytest -m gpu tests/kernels/test_gemm_moe_gpu.py -q -k "deepgemm or dense" > $D/gpu_tests.log 2>&1; echo "tests rc=$?"
tail -3 $D/gpu_tests.log
timeout 200 python3 -m scripts.gpu.diag_dg13 > $D/diag_dg13.log 2>&1; echo "diag rc=$?"
cut -c1-200 $D/diag_dg13.log | grep -v Warning | head -30
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
