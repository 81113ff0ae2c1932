"""DeepGEMM's SM90 FP8 GEMM kernel, launched by our own host code (kernels/csrc/deepgemm_sm90.cu).

Role: the fastest block-scaled FP8 GEMM we have on the H200, for the dense linears (QKV, O) and the
prefill MoE's grouped expert GEMMs. The sgl-deep-gemm wheel's own binding rejects torch 2.11
tensors (run R), but its kernels ship as headers; we compile one small shared library per tile
configuration with nvcc (seconds, cached on disk), load it with ctypes and pass raw pointers, so
no torch ABI is involved.

Operands (the layouts the kernel reads through TMA):
  a   e4m3 [M, K]         row stride a multiple of 16 bytes; K need not be a multiple of 128 (TMA
                          zero-fills the last block's missing columns)
  sfa fp32 [M, KB]        1x128 activation scales, M-major: strides (1, M_al), M_al % 4 == 0
                          (`quantize_act_1x128(..., m_align=4)` returns exactly this)
  b   e4m3 [G*N, K]       weights, K-major; G experts stacked for the grouped form
  sfb fp32 [G, NB, KB]    128x128 weight scales
  d   bf16 [M, N]
Grouped (M-grouped contiguous): row r of `a` belongs to expert layout[r] (int32; -1 = padding row),
each expert's rows contiguous and padded to BLOCK_M.

GPU-only: building needs nvcc and the deep_gemm headers; running needs an SM90 GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import ConfigError

SOURCE = Path(__file__).parent / "csrc" / "deepgemm_sm90.cu"
SMEM_LIMIT = 232448  # H100/H200 max dynamic shared memory per block (227 KB)
NORMAL, GROUPED = 0, 1


@dataclass(frozen=True, slots=True)
class DgConfig:
    block_m: int = 128
    block_n: int = 128
    stages: int = 0  # 0: as many as fit
    mcast: int = 1  # CTAs of a cluster sharing one TMA load (1 or 2)
    mcast_on_a: bool = False
    gemm_type: int = NORMAL
    shape_n: int = 0  # N compiled into the kernel (0: runtime); the launcher refuses another N
    shape_k: int = 0  # K likewise (the augmented K' of a dense linear)

    def swizzle_d(self) -> int:
        """Largest TMA swizzle (bytes) whose bf16 atom divides BLOCK_N."""
        for sw in (128, 64, 32):
            if self.block_n % (sw // 2) == 0:
                return sw
        return 0

    def smem_bytes(self, stages: int, max_k: int = 0) -> int:
        """Mirror of the launcher's smem_bytes, to pick the stage count (the launcher raises the
        kernel's limit to the real size for each K and reports a refusal)."""
        up = lambda a, b: -(-a // b) * b  # noqa: E731
        max_k = max_k or self.shape_k or 8192
        d = up(self.block_m * self.block_n * 2, 1024)
        per_stage = self.block_m * 128 + self.block_n * 128 + up(self.block_m * 4, 128)
        sfb = up(-(-max_k // 128) * (1 if 128 % self.block_n == 0 else 2) * 4, 8)
        return d + stages * per_stage + sfb + stages * 16

    def resolved_stages(self) -> int:
        if self.stages:
            return self.stages
        s = 1
        while self.smem_bytes(s + 1) <= SMEM_LIMIT:
            s += 1
        return s


def include_dir() -> Path:
    """deep_gemm's headers (the wheel's `include/`), found without importing its binding."""
    env = os.environ.get("TANDEM_DEEPGEMM_INCLUDE")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("deep_gemm")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("DeepGEMM headers not found: install the sgl-deep-gemm wheel or set "
                          "TANDEM_DEEPGEMM_INCLUDE")
    inc = Path(next(iter(spec.submodule_search_locations))) / "include"
    if not (inc / "deep_gemm" / "impls" / "sm90_fp8_gemm_1d2d.cuh").exists():
        raise ConfigError(f"DeepGEMM headers incomplete under {inc}")
    return inc


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "deepgemm"


def _nvcc() -> str:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    raise ConfigError("nvcc not found (set NVCC or CUDA_HOME): needed to build the DeepGEMM launcher")


def build_flags(cfg: DgConfig, num_sms: int) -> list[str]:
    return [f"-DTD_BLOCK_M={cfg.block_m}", f"-DTD_BLOCK_N={cfg.block_n}",
            f"-DTD_STAGES={cfg.resolved_stages()}", f"-DTD_MCAST={cfg.mcast}",
            f"-DTD_MCAST_ON_A={int(cfg.mcast_on_a)}", f"-DTD_NUM_SMS={num_sms}",
            # the group count matters to masked/batched forms only; contiguous takes it at run time
            f"-DTD_GEMM_TYPE={cfg.gemm_type}", "-DTD_NUM_GROUPS=1",
            f"-DTD_SWIZZLE_D={cfg.swizzle_d()}", f"-DTD_SHAPE_N={cfg.shape_n}", f"-DTD_SHAPE_K={cfg.shape_k}"]


def library_path(cfg: DgConfig, num_sms: int, build: bool = True) -> Path:
    """The compiled launcher for cfg, built if missing. Keyed by our source, the flags and the
    DeepGEMM version, so a cache built on another machine (same GPU architecture) is reused."""
    inc = include_dir()
    version = (inc.parent / "VERSION").read_text().strip() if (inc.parent / "VERSION").exists() else "?"
    flags = build_flags(cfg, num_sms)
    key = hashlib.sha256((SOURCE.read_text() + " ".join(flags) + version).encode()).hexdigest()[:16]
    out = cache_dir() / f"dg_sm90_{key}.so"
    if out.exists() or not build:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_nvcc(), "-O3", "-std=c++20", "-gencode", "arch=compute_90a,code=sm_90a", "-shared",
           "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", "-w", f"-I{inc}", *flags, str(SOURCE)]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([*cmd, "-o", str(tmp_out)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise ConfigError(f"building the DeepGEMM launcher failed ({' '.join(flags)}):\n"
                              f"{proc.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    return out


@functools.cache
def _load(cfg: DgConfig, num_sms: int) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path(cfg, num_sms)))
    lib.tandem_dg_gemm.restype = ctypes.c_int
    lib.tandem_dg_gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_uint32] * 4 + [ctypes.c_uint64] * 3 + [
        ctypes.c_uint32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    return lib


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of the device (the persistent grid size), looked up once per device, not per GEMM."""
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def unavailable_reason(cfgs: list[DgConfig], device: torch.device) -> str | None:
    """Why DeepGEMM cannot run here (None: it can): an SM90 device, the headers, and each launcher
    built (nvcc, first time only; cached) and loaded. No kernel runs; the caller logs the reason
    when it picks another backend, so a broken toolchain costs speed, not the worker."""
    if device.type != "cuda":
        return "not a CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"needs SM90 (Hopper), device has SM{major}x"
    try:
        include_dir()
        prepare(cfgs, device)
    except (ConfigError, OSError, subprocess.SubprocessError) as e:
        return str(e).strip().splitlines()[0][:300]
    return None


def prepare(cfgs: list[DgConfig], device: torch.device) -> None:
    """Builds (if missing) and loads each launcher for this device."""
    for cfg in dict.fromkeys(cfgs):
        _load(cfg, num_sms(device))


def gemm(cfg: DgConfig, a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
         d: torch.Tensor, layout: torch.Tensor | None = None) -> torch.Tensor:
    """d [M, N] bf16 = (a, sfa) x (b, sfb)^T. a e4m3 [M, K]; sfa fp32 [M, KB] strides (1, M_al); b e4m3
    [G*N, K]; sfb fp32 [G, NB, KB] (or [NB, KB] for G = 1), contiguous; layout int32 [M] if grouped."""
    m, k = a.shape
    n = d.shape[1]
    groups = b.shape[0] // n
    assert a.dtype == b.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16
    assert a.stride(1) == b.stride(1) == d.stride(1) == 1 and b.shape[1] == k
    assert (a.stride(0) % 16, b.stride(0) % 16, (d.stride(0) * 2) % 16) == (0, 0, 0), "TMA row alignment"
    kb = -(-k // 128)
    m_al = sfa.stride(1)
    assert sfa.shape == (m, kb) and sfa.stride(0) == 1 and m_al % 4 == 0 and m_al >= m
    assert sfb.is_contiguous() and sfb.numel() == groups * -(-n // 128) * kb and b.shape[0] == n * groups
    assert (layout is not None) == (cfg.gemm_type == GROUPED)
    if cfg.gemm_type == GROUPED:
        assert layout.dtype == torch.int32 and layout.numel() == m and m % cfg.block_m == 0
    if m == 0:
        return d
    lib = _load(cfg, num_sms(a.device))
    err = ctypes.create_string_buffer(512)
    rc = lib.tandem_dg_gemm(a.data_ptr(), sfa.data_ptr(), b.data_ptr(), sfb.data_ptr(), d.data_ptr(),
                            layout.data_ptr() if layout is not None else None,
                            m, n, k, m_al, a.stride(0), b.stride(0), d.stride(0), groups,
                            torch.cuda.current_stream(a.device).cuda_stream, err, len(err))
    if rc != 0:
        raise RuntimeError(f"DeepGEMM sm90 launch failed: {err.value.decode(errors='replace')}")
    return d
