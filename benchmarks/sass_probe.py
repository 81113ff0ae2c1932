"""What our Triton kernels compile to on sm_90a, read on a machine without a GPU: registers, spills, shared memory
and the load / store / barrier / math instructions of each kernel, at the real shapes and tiles of a named probe.

Each probe calls a real wrapper (kernels/*.py) on CPU tensors of the real shapes with TRITON_INTERPRET=1; the
launches are recorded, not run (no kernel executes). Each launch is then compiled for sm_90a in a subprocess
without the interpreter, with the GPU constexprs and the specialisation Triton's launcher would apply to those
arguments (16-byte aligned pointers and ints divisible by 16 as `tt.divisibility` 16, ints equal to 1 as
constants): without it the loads come out scalar, unlike the real launch's. Triton's wheel ships ptxas, cuobjdump
and nvdisasm. This machine's Triton may be newer than the GPU image's; timings still need the GPU.

    python -m benchmarks.sass_probe fp8_rows gemv_rows      # or: --list
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

GPU_CONSTEXPRS = {"HW_CVT": True, "DOT_F32": False, "LIBDEVICE": True, "PDL": True}
OPS = ("LDG", "STG", "LDS", "STS", "LDSM", "BAR", "FFMA", "HFMA2", "HGMMA", "QGMMA", "HMMA", "UTMALDG", "F2FP", "SHFL",
       "LOP3", "SHF", "HADD2", "FADD", "FMUL", "MUFU", "PRMT", "I2F", "F2F")


def _probe_fp8_rows() -> None:
    import torch

    from kernels.fp8_rows import fp8_rows_linear
    for n, k in ((5120, 2880), (2880, 4096)):  # gpt-oss QKV, O
        fp8_rows_linear(torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                        torch.ones(-(-n // 128), -(-k // 128)), torch.zeros(n, dtype=torch.bfloat16))


def _probe_gemv_rows() -> None:
    import torch

    from kernels.gemv import few_token_linear
    for n, k in ((5120, 2880), (2880, 4096)):
        few_token_linear(torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(n, k, dtype=torch.bfloat16),
                         torch.zeros(n, dtype=torch.bfloat16))


def _probe_moe_small() -> None:
    """The few-token MoE at one token of gpt-oss-20b (4 experts' weights: the kernels index them by id)."""
    import torch

    from kernels.fp8_quant import quantize_act_1x128
    from kernels.interface import ExpertWeights
    from kernels.moe_small import SmallBatchMoE
    h = i = 2880
    w = ExpertWeights(torch.zeros(4, 2 * i, h, dtype=torch.float8_e4m3fn), torch.ones(4, 2 * i // 128, -(-h // 128)),
                      torch.zeros(4, 2 * i, dtype=torch.bfloat16), torch.zeros(4, h, i, dtype=torch.float8_e4m3fn),
                      torch.ones(4, -(-h // 128), -(-i // 128)), torch.zeros(4, h, dtype=torch.bfloat16), 0, 32,
                      1.702, 7.0)
    x = torch.zeros(1, h, dtype=torch.bfloat16)
    SmallBatchMoE()(x, torch.zeros(1, 32, dtype=torch.bfloat16), 4, w, quantize_act_1x128(x))


def _probe_moe_mxfp4(configs=(None,)) -> None:
    """The one-token MoE on MXFP4 experts (kernels/moe_mxfp4.py) at gpt-oss-20b widths, default tiles."""
    import torch

    from kernels.moe_mxfp4 import Mxfp4Experts, SmallBatchMxfp4MoE
    h = i = 2880

    def mx(n: int, k: int):
        return torch.zeros(4, n, k // 32, 16, dtype=torch.uint8), torch.full((4, n, k // 32), 120, dtype=torch.uint8)

    w = Mxfp4Experts.from_blocks(*mx(2 * i, h), torch.zeros(4, 2 * i, dtype=torch.bfloat16), *mx(h, i),
                                 torch.zeros(4, h, dtype=torch.bfloat16), alpha=1.702, limit=7.0)
    for cfg in configs:
        SmallBatchMxfp4MoE(cfg)(torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(1, 32, dtype=torch.bfloat16), 4, w)


def _probe_moe_mxfp4_f16() -> None:
    """The same with products summed in f16x2 (Mxfp4Config.dot f16_cvt, f16_lop) at 8 and 16 rows, 1 and 2 warps,
    and with the next step's loads first."""
    from kernels.moe_mxfp4 import Mxfp4Config
    _probe_moe_mxfp4([Mxfp4Config(dot=d, block_n1=n, block_n2=n, num_warps=w)
                      for d in ("f16_cvt", "f16_lop") for n, w in ((8, 1), (16, 1), (16, 2))]
                     + [Mxfp4Config(dot="f16_lop", block_n1=n, block_n2=n, num_warps=1, prefetch=True) for n in (8, 4)])


PROBES = {"fp8_rows": _probe_fp8_rows, "gemv_rows": _probe_gemv_rows, "moe_small": _probe_moe_small,
          "moe_mxfp4": _probe_moe_mxfp4, "moe_mxfp4_f16": _probe_moe_mxfp4_f16}


@contextmanager
def recording(run_kernels: bool = False):
    """Records every interpreted launch (TRITON_INTERPRET=1) as (module, kernel, signature, constexprs,
    divisibility, options), keyed so a launch repeated with the same specialisation counts once. With
    run_kernels the interpreter also runs each launch (a caller that reads its outputs); else nothing runs."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import mangle_type

    seen: dict[str, dict] = {}
    run = InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        params = {p.name: p for p in inspect.signature(self.fn).parameters.values()}
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        sig, const, div16 = {}, {}, []
        for name, v in bound.items():
            if "constexpr" in str(params[name].annotation) or v is None:
                const[name] = GPU_CONSTEXPRS.get(name, v)
            elif isinstance(v, int) and not isinstance(v, bool) and v == 1:
                const[name] = 1  # Triton's launcher specialises ints equal to 1
            else:
                sig[name] = mangle_type(v)  # the type string Triton's own launcher would use
                if (hasattr(v, "data_ptr") and v.data_ptr() % 16 == 0) or (isinstance(v, int) and v % 16 == 0):
                    div16.append(name)
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        rec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "sig": sig, "const": const, "div16": div16,
               "opts": opts}
        seen[json.dumps(rec, sort_keys=True, default=str)] = rec
        return run(self, *args, grid=grid, warmup=warmup, **kwargs) if run_kernels else None

    InterpretedFunction.run = spy
    try:
        yield seen
    finally:
        InterpretedFunction.run = run


def record(probe) -> list[dict]:
    """The launches probe() makes; nothing runs."""
    with recording() as seen:
        probe()
    return list(seen.values())


COMPILE = """
import importlib, json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for i, rec in enumerate(json.load(sys.stdin)):
    fn = getattr(importlib.import_module(rec["module"]), rec["kernel"])
    sig = dict(rec["sig"]) | {k: "constexpr" for k in rec["const"]}
    consts = {(fn.arg_names.index(k),): v for k, v in rec["const"].items()}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in rec["div16"]}
    try:
        ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=rec["opts"])
    except Exception as e:
        chain = []
        while e is not None and len(chain) < 8:  # the root cause (a Python error inside the kernel) comes last
            chain.append(str(e)[-1500:])
            e = e.__cause__ or e.__context__
        out.append({"cubin": None, "shared": None, "error": " | ".join(chain)[-3000:]})
        continue
    path = f"{sys.argv[1]}/{i}-{rec['kernel']}.cubin"
    open(path, "wb").write(ck.asm["cubin"])
    out.append({"cubin": path, "shared": ck.metadata.shared, "error": None})
print(json.dumps(out))
"""


def build_sm90(recs: list[dict], workdir: Path) -> list[dict]:
    """Each recorded launch compiled for sm_90a down to a cubin in workdir (Triton's own ptxas), in a subprocess
    without the interpreter: {cubin, shared, error} per launch, in order (error: the compiler's message)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE, str(workdir)], input=json.dumps(recs), env=env,
                          capture_output=True, text=True, timeout=900, cwd=os.getcwd())
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tool(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def analyse(cubin: str) -> dict:
    """Registers and local stack (cuobjdump -res-usage) and an opcode histogram (nvdisasm) of one cubin."""
    res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    ops = Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    return {"regs": int(regs.group(1)) if regs else None, "stack": int(stack.group(1)) if stack else None,
            "loop": _loop_length(sass), "ops": {op: n for op, n in sorted(ops.items()) if op.split(".")[0] in OPS}}


def _loop_length(sass: str) -> int | None:
    """Instructions in the longest backward branch's body (a kernel's main K loop), None without one."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", ln))}
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", ln)
        if m and labels.get(m.group(1), i) < i:
            n = sum(1 for x in lines[labels[m.group(1)]:i + 1] if re.match(r"\s+/\*[0-9a-f]+\*/", x))
            best = max(best or 0, n)
    return best


def probe_report(names: list[str], workdir: Path) -> list[dict]:
    recs = [r for name in names for r in record(PROBES[name])]
    built = build_sm90(recs, workdir)
    failed = [f"{r['kernel']}: {b['error']}" for r, b in zip(recs, built) if b["error"]]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [{"kernel": r["kernel"], "const": r["const"], "opts": r["opts"], "shared": b["shared"],
             **analyse(b["cubin"])}
            for r, b in zip(recs, built)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("probes", nargs="*", help=f"of {', '.join(PROBES)}")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default="/tmp/sass_probe", help="where the cubins go")
    a = ap.parse_args()
    if a.list or not a.probes:
        print("\n".join(f"{k}: {(v.__doc__ or '').strip()}" for k, v in PROBES.items()))
        return
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels' modules are imported (by the probes)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for row in probe_report(a.probes, Path(a.out)):
        tiles = {k: v for k, v in row["const"].items() if k.startswith(("BLOCK", "SPLIT", "NUM", "UNROLL"))}
        print(f"{row['kernel']} {tiles} {row['opts']}: {row['regs']} regs, stack {row['stack']}, "
              f"smem {row['shared']} B, loop {row['loop']} instructions; {row['ops']}")


if __name__ == "__main__":
    main()
