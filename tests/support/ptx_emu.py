"""The few PTX instructions our Triton kernels' inline asm uses, run on numpy arrays: a CPU check of the asm text
itself (the interpreter never runs PTX). Registers are uint32 (or uint16 for .b16) arrays, one lane per element;
`$n` operands are given by the caller, outputs come back by number. Floating-point ops round as the GPU does where
numpy can say so (f16 arithmetic: the exact result rounded once to f16; fp32 adds in float32).

    out = run_asm(asm_text, inputs={4: addresses}, n_out=4, memory=words)
"""

from __future__ import annotations

import re

import numpy as np


def _f16_bits(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, dtype=np.float16).view(np.uint16)


def _f16(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def _halves(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (r & 0xFFFF).astype(np.uint16), (r >> 16).astype(np.uint16)


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << np.uint32(16))


def _round_f16(exact: np.ndarray, satfinite: bool = False) -> np.ndarray:
    """float64 -> f16 bits, round to nearest even (numpy's float64 -> float16 cast rounds once)."""
    x = np.asarray(exact, dtype=np.float64)
    if satfinite:
        x = np.clip(x, -65504.0, 65504.0)
    with np.errstate(over="ignore"):
        return _f16_bits(x.astype(np.float16))


def _e4m3(byte: np.ndarray) -> np.ndarray:
    """e4m3 bytes -> float64 values (no NaN handling: our codes never make 0x7f / 0xff)."""
    b = byte.astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return sign * mag


def run_asm(asm: str, inputs: dict[int, np.ndarray], n_out: int, memory: np.ndarray | None = None
            ) -> list[np.ndarray]:
    """Runs asm (a `{ .reg ...; op ...; }` block) lane-wise; memory: uint32 words at byte address 4 * index."""
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v) for k, v in inputs.items()}
    body = asm.strip()
    body = body[1:-1] if body.startswith("{") else body

    def get(name: str) -> np.ndarray:
        name = name.strip()
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", name):
            return np.uint32(int(name, 0) & 0xFFFFFFFF)
        return regs[name]

    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        if op.startswith("ld.global") and ".v4.b32" in op:
            dst, addr = re.fullmatch(r"\{(.+)\},\s*\[(.+)\]", rest.strip()).groups()
            idx = (get(addr).astype(np.int64)) // 4
            for i, d in enumerate(dst.split(",")):
                regs[d.strip()] = memory[idx + i].astype(np.uint32)
            continue
        if op == "mov.b32" and rest.lstrip().startswith("{"):
            dst, src = re.fullmatch(r"\{(.+)\},\s*(\S+)", rest.strip()).groups()
            lo, hi = (d.strip() for d in dst.split(","))
            regs[lo], regs[hi] = _halves(get(src))
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [get(a) for a in args[1:]]
        if op == "mov.b32":
            out = srcs[0].astype(np.uint32)
        elif op == "shl.b32":
            out = (srcs[0].astype(np.uint32) << np.uint32(int(srcs[1]))).astype(np.uint32)
        elif op in ("shr.b32", "shr.u32"):
            out = srcs[0].astype(np.uint32) >> np.uint32(int(srcs[1]))
        elif op == "and.b32":
            out = srcs[0].astype(np.uint32) & srcs[1]
        elif op == "or.b32":
            out = srcs[0].astype(np.uint32) | srcs[1]
        elif op == "add.u32":
            out = (srcs[0].astype(np.uint64) + np.uint64(srcs[1])).astype(np.uint32)
        elif op in ("cvt.rn.f16x2.f32", "cvt.rn.satfinite.f16x2.f32"):  # a -> upper half, b -> lower
            f = [s.astype(np.uint32).view(np.float32).astype(np.float64) for s in srcs]
            out = _pack(_round_f16(f[1], "satfinite" in op), _round_f16(f[0], "satfinite" in op))
        elif op == "cvt.rn.f16x2.e4m3x2":  # the low byte -> the lower half
            b = srcs[0].astype(np.uint32)
            out = _pack(_round_f16(_e4m3(b & 0xFF)), _round_f16(_e4m3((b >> 8) & 0xFF)))
        elif op in ("mul.rn.f16x2", "fma.rn.f16x2"):
            parts = [[_f16(h).astype(np.float64) for h in _halves(s.astype(np.uint32))] for s in srcs]
            lanes = [parts[0][i] * parts[1][i] + (parts[2][i] if op.startswith("fma") else 0.0) for i in (0, 1)]
            out = _pack(_round_f16(lanes[0]), _round_f16(lanes[1]))
        elif op == "cvt.f32.f16":
            out = _f16(srcs[0]).astype(np.float32).view(np.uint32)
        elif op == "add.f32":
            out = (srcs[0].view(np.float32) + srcs[1].view(np.float32)).astype(np.float32).view(np.uint32)
        else:
            raise NotImplementedError(f"ptx_emu: {op}")
        regs[d] = np.asarray(out)
    return [regs[f"${k}"] for k in range(n_out)]
