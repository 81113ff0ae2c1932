"""Our DeepGEMM SM90 launcher (kernels/csrc/deepgemm_sm90.cu) compiles on the CPU machine with nvcc
for sm_90a against the sgl-deep-gemm wheel's headers: a dense launcher with N and K compiled in and
a grouped (MoE) one, the way workers build them at start-up. Needs nvcc and the headers that
scripts/bootstrap.sh fetches where nvcc exists (else skipped, with the reason). Running the kernels
needs an H200: tests/kernels/test_gemm_moe_gpu.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kernels import deepgemm_linear as dl
from kernels import deepgemm_sm90 as dg
from kernels import moe_dg

HEADERS = Path(os.environ.get("TANDEM_DEEPGEMM_INCLUDE",
                              Path(__file__).parents[2] / ".cache" / "deepgemm-headers" / "deep_gemm" / "include"))

pytestmark = [
    pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                       reason="no nvcc on this machine"),
    pytest.mark.skipif(not (HEADERS / "deep_gemm" / "impls" / "sm90_fp8_gemm_1d2d.cuh").exists(),
                       reason=f"DeepGEMM headers not at {HEADERS} (scripts/bootstrap.sh fetches them)"),
]


def test_launchers_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DEEPGEMM_INCLUDE", str(HEADERS))
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    dense = dl.config_for(8192, 2880, 4099)  # O with its bias block, N and K' compiled in
    assert (dense.shape_n, dense.shape_k) == (2880, 4099)
    cfgs = (dense, moe_dg.GATE_UP)
    with ThreadPoolExecutor(len(cfgs)) as pool:  # two nvcc processes at once: ~15 s instead of ~30
        libs = list(pool.map(lambda c: dg.library_path(c, 132), cfgs))
    for cfg, lib in zip(cfgs, libs):
        assert lib.exists() and lib.parent == tmp_path / "deepgemm"
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                                 check=True).stdout
        assert " T tandem_dg_gemm" in symbols
        assert dg.library_path(cfg, 132) == lib  # cached: the key covers source, flags and version
    assert len(list((tmp_path / "deepgemm").glob("*.so"))) == 2
