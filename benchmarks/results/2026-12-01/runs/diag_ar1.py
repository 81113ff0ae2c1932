"""Our one-shot all-reduce (kernels/allreduce.py) with two ranks on whatever GPUs there are.

On one GPU both ranks share it (gloo process group; torch symmetric memory refuses two ranks on one
device, so each rank allocates its buffer and signal pad with torch and the other maps them through
CUDA IPC — the kernel only sees addresses): the two processes' kernels time-slice, so this checks
the barrier protocol and the arithmetic (bit-exact, repeated calls, CUDA-graph replays), not speed.
On two GPUs it is the real thing (NCCL group, symmetric memory). Prints one line per case and exits non-zero on any mismatch or hang.

    python -m scripts.gpu.diag_ar1
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp


MAX_NUMEL = 256 * 2880
PAD_BYTES = 4096


def _shared_one_gpu(rank: int, world: int, dev: torch.device, mine, theirs):
    """Buffers and pads on one device, exchanged as CUDA IPC handles (torch.multiprocessing queues)."""
    from kernels.allreduce import OneShotAllReduce

    buf = torch.empty(MAX_NUMEL, dtype=torch.bfloat16, device=dev)
    pad = torch.zeros(PAD_BYTES // 4, dtype=torch.int32, device=dev)
    torch.cuda.synchronize()
    mine.put((buf, pad))
    peer_buf, peer_pad = theirs.get(timeout=60)
    bufs = [buf, peer_buf] if rank == 0 else [peer_buf, buf]
    pads = [pad, peer_pad] if rank == 0 else [peer_pad, pad]
    ar = OneShotAllReduce(rank, world, [b.data_ptr() for b in bufs], [p.data_ptr() for p in pads], PAD_BYTES,
                          MAX_NUMEL, dev)
    ar._keep = (bufs, pads)
    return ar


def _worker(rank: int, world: int, port: int, q, qs) -> None:
    import torch.distributed as dist

    from kernels.allreduce import reduce_sum_reference
    from model.parallel import _tandem_one_shot

    try:
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        lines, ok = [], True
        if backend == "gloo":
            ar = _shared_one_gpu(rank, world, dev, qs[rank], qs[1 - rank])
        else:
            ar = _tandem_one_shot(None, MAX_NUMEL, dev)
        dist.barrier()
        for tokens in (1, 7, 128, 256):
            g = torch.Generator(device=dev).manual_seed(tokens * 10 + rank)
            x = torch.randn(tokens, 2880, device=dev, dtype=torch.bfloat16, generator=g)
            xs = [torch.empty_like(x) for _ in range(world)]
            if backend == "gloo":  # gloo gathers CPU tensors
                cpu = [torch.empty_like(x, device="cpu") for _ in range(world)]
                dist.all_gather(cpu, x.cpu())
                xs = [c.to(dev) for c in cpu]
            else:
                dist.all_gather(xs, x)
            want = reduce_sum_reference(xs)
            t0 = time.perf_counter()
            eager = [bool(torch.equal(ar(x), want)) for _ in range(5)]
            torch.cuda.synchronize()
            t_eager = (time.perf_counter() - t0) / 5 * 1e6
            graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ar(x)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                y = ar(x)
            replays = []
            for _ in range(5):
                graph.replay()
                torch.cuda.synchronize()
                replays.append(bool(torch.equal(y, want)))
            ok &= all(eager) and all(replays)
            lines.append(f"rank {rank} {backend} tokens {tokens}: eager exact {sum(eager)}/5 ({t_eager:.0f} us/call "
                         f"incl. sync), graph exact {sum(replays)}/5")
        q.put((rank, ok, "\n".join(lines)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put((rank, False, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q, qs = ctx.Queue(), [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q, qs), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    ok = True
    try:
        for _ in procs:
            rank, good, text = q.get(timeout=float(os.environ.get("AR_TIMEOUT", "150")))
            print(text, flush=True)
            ok &= good
    except Exception as e:  # noqa: BLE001 - a hang shows as a timeout here
        print(f"FAILED: no result ({type(e).__name__}): a rank hung or died", flush=True)
        ok = False
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    print("all-reduce diag:", "ok" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
