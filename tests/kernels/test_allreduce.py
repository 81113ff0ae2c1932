"""Our one-shot all-reduce (kernels/allreduce.py).

CPU: the kernel compiles for sm_90 (Triton's own ptxas-free PTX path), with the properties the
design relies on — 16-byte peer loads that bypass L1, system-scope release/acquire CAS for the
barriers, each executed by one thread — and the arithmetic reference. The multi-rank run needs
GPUs with peer access: `test_two_gpus_bit_exact` (marked gpu) and benchmarks/bench_tp.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from common.errors import ConfigError
from model.config import preset
from model.parallel import ParallelConfig


_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.allreduce import BLOCK, NUM_WARPS, _one_shot_kernel
rank, world = int(sys.argv[1]), int(sys.argv[2])
sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "bufs_ptr": "*i64", "pads_ptr": "*i64", "n": "i32",
       "RANK": "constexpr", "WORLD": "constexpr", "BLOCK": "constexpr"}
aligned = [["tt.divisibility", 16]]  # what a launch with torch tensors and n % 16 == 0 specialises to
src = ASTSource(_one_shot_kernel, sig, constexprs={"RANK": rank, "WORLD": world, "BLOCK": BLOCK},
                attrs={(0,): aligned, (1,): aligned, (4,): aligned})
print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS}).asm["ptx"])
"""


def _ptx(rank: int, world: int) -> str:
    """sm_90 PTX of the kernel, compiled in a fresh process: the interpreter tests in this session
    set TRITON_INTERPRET=1 at import, which turns every later @triton.jit into an interpreted one.
    (For the same reason this module imports kernels.allreduce only inside tests: a @triton.jit
    decorated at collection time, before those modules set the variable, breaks their kernels.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(rank), str(world)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("rank,world", [(0, 2), (3, 4)])
def test_kernel_compiles_for_sm90_with_the_intended_memory_operations(rank, world):
    ptx = _ptx(rank, world)
    accesses = set(re.findall(r"(?:ld|st)\.global[.a-z0-9]*", ptx))
    assert "ld.global.cv.v4.b32" in accesses  # every rank's buffer: 16-byte loads, fetched anew
    assert "st.global.v4.b32" in accesses  # x -> own buffer and the output: 16-byte stores
    assert not any(a.endswith((".b16", ".u16")) for a in accesses), accesses  # no scalar bf16 path
    atoms = re.findall(r"^\s*(@%p\d+)?\s*atom\.global\.(\w+)\.sys\.cas\.b32", ptx, flags=re.M)
    # two barriers, each: one release CAS per peer, then one acquire CAS per peer (spin loops)
    assert sorted(sem for _, sem in atoms) == ["acquire"] * 2 * (world - 1) + ["release"] * 2 * (world - 1)
    assert all(pred for pred, _ in atoms), "a barrier CAS must be predicated to a single thread"


def test_reference_is_the_rank_ordered_fp32_sum_rounded_once():
    from kernels.allreduce import reduce_sum_reference  # lazily: see _ptx

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 2880, generator=g).to(torch.bfloat16) * 10 ** i for i in range(3)]
    want = (xs[0].float() + xs[1].float() + xs[2].float()).to(torch.bfloat16)
    assert torch.equal(reduce_sum_reference(xs), want)
    pairwise = (xs[0] + xs[1]) + xs[2]  # bf16 rounding after each add differs somewhere
    assert not torch.equal(reduce_sum_reference(xs), pairwise)


def test_unknown_fast_allreduce_impl_is_rejected():
    with pytest.raises(ConfigError, match="fast all-reduce"):
        ParallelConfig(fast_allreduce_impl="nccl2").validate(preset("tiny"))


# ---- two GPUs ----------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    from kernels.allreduce import reduce_sum_reference
    from model.parallel import _tandem_one_shot

    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        ok = True
        for tokens in (1, 7, 128, 256):
            g = torch.Generator(device="cuda").manual_seed(tokens * 10 + rank)
            x = torch.randn(tokens, 2880, device="cuda", dtype=torch.bfloat16, generator=g)
            xs = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(xs, x)
            ar = _tandem_one_shot(None, 256 * 2880, x.device)
            for _ in range(3):  # pads must be back at zero after every call
                ok &= bool(torch.equal(ar(x), reduce_sum_reference(xs)))
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ar(x)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                y = ar(x)
            for _ in range(3):
                graph.replay()
                torch.cuda.synchronize()
                ok &= bool(torch.equal(y, reduce_sum_reference(xs)))
        q.put((rank, ok, ""))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, False, f"{type(e).__name__}: {e}"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run this file alone on the GPU")
def test_two_gpus_bit_exact():
    import torch.multiprocessing as mp

    from launcher.ports import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(ok for _, ok, _ in results), results
