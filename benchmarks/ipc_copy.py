"""Same-node KV push without UCX: can SM-driven copies through CUDA IPC beat NIXL's copy engines?

benchmarks/nixl_probe.py found UCX cuda_ipc capped at ~250-270 GB/s between two H200s (copy engines)
with 5-7 us of host time per descriptor, while a plain `copy_` moves 393 GB/s. This measures the
alternative the notes propose for issue #7 before any product code depends on it:

  decode process (GPU1) allocates a 120b-shaped KV pool and shares its tensors with the prefill
  process through torch.multiprocessing (CUDA IPC handles); the prefill process (GPU0) writes a
  request's pages straight into them, for 8k / 32k tokens and contiguous / 16-page-run / scattered
  decode pages, two ways:
    kernel   one Triton launch for all layers: each program copies a chunk of one (layer, K/V, page)
             block from the local pool to the peer pool through UVA pointers (SM stores over NVLink);
             page scatter costs nothing extra
    staged   gather into a contiguous buffer on GPU0, one `copy_` to GPU1, scatter there (3 launches)
  Every transfer is verified byte-exact by the decode process against the kv_transfer pattern.

    python -m benchmarks.ipc_copy                      # nvidia-h200-x2; writes $OUT/ipc_copy.json
    python -m benchmarks.ipc_copy --devices cpu cpu --tokens 256 --layers 4 --iters 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as tmp
import triton
import triton.language as tl

from benchmarks.kv_layout import (HEADS, HEAD_DIM, PAGE, RING, WINDOW, dst_pages, fill_layer, make_spec, src_pages,
                                   transfer_bytes, verify)
from kv_transfer.plan import GroupGeometry, page_pairs
from model.kv_cache import KVPool, PageGroup, SeqPages

BLOCK_ELEMS = HEADS * PAGE * HEAD_DIM  # one (layer, K/V, page) block: H * P * D elements
ELT = 2  # bf16 bytes
CHUNK = 2048


@triton.jit
def _page_copy_kernel(src_ptr, dst_ptr, src_off, dst_off, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (i, c) copies elements [c*CHUNK, (c+1)*CHUNK) of block i (offsets in elements)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_off + i)
    d = tl.load(dst_off + i)
    e = c * CHUNK + tl.arange(0, CHUNK)
    tl.store(dst_ptr + d + e, tl.load(src_ptr + s + e))


def block_offsets(spec, src_np: tuple[int, int], dst_np: tuple[int, int], n: int, src, dst
                  ) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], int]:
    """Per page group: element offsets (within the group's pool tensor) of every (layer, K/V, page)
    block to copy, from the transfer plan's own pool geometry (kv_transfer.plan)."""
    out, blocks = {}, 0
    for g in PageGroup:
        if not spec.layers(g):
            continue
        sp, dp = page_pairs(g, src, dst, n, PAGE, WINDOW, src_np[g], dst_np[g])
        nl = len(spec.layers(g))
        geo_s, geo_d = (GroupGeometry(nl, npages[g], HEADS, PAGE, HEAD_DIM, ELT) for npages in (src_np, dst_np))
        so = np.concatenate([geo_s.offsets(li, kv, sp, 0) for li in range(nl) for kv in (0, 1)]) // ELT
        do = np.concatenate([geo_d.offsets(li, kv, dp, 0) for li in range(nl) for kv in (0, 1)]) // ELT
        out[g] = (so.astype(np.int64), do.astype(np.int64))
        blocks += len(so)
    return out, blocks


def decode_main(dev: str, layers: int, nf: int, q_to, q_from) -> None:
    try:
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        pool = KVPool(make_spec(layers, nf, RING), dev)
        if not dev.startswith("cuda"):
            for t in pool.pools:
                t.share_memory_()
        q_from.put(("pools", [pool.pools[g] for g in PageGroup], tuple(pool.spec.num_pages)))
        while True:
            cmd = q_to.get()
            if cmd[0] == "stop":
                break
            _, full, ring, n, salt = cmd
            for t in pool.pools:
                t.zero_()
            q_from.put(("zeroed",))
            cmd = q_to.get()  # ("check",) once the prefill side finished writing
            assert cmd == ("check",), cmd
            if dev.startswith("cuda"):
                torch.cuda.synchronize(dev)
            q_from.put(("verified", verify(pool, SeqPages(list(full), list(ring)), n, salt)))
    except Exception as e:  # noqa: BLE001 - report to the parent
        q_from.put(("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=5)))


def prefill_main(args, q_to, q_from, result_q) -> None:
    rows = []
    try:
        dev = args.devices[0]
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        nf_max = -(-max(args.tokens) // PAGE)
        pool = KVPool(make_spec(args.layers, nf_max, RING), dev)
        for layer in range(args.layers):
            fill_layer(pool, layer, 0)
        msg = q_from.get(timeout=120)
        assert msg[0] == "pools", msg
        peer_pools, dst_np = msg[1], msg[2]
        if dev.startswith("cuda"):  # peer access for UVA stores into the IPC-mapped pool
            torch.empty(1, device=args.devices[1]).copy_(torch.empty(1, device=dev))
        sync = (lambda: [torch.cuda.synchronize(d) for d in args.devices]) if dev.startswith("cuda") else (lambda: None)
        for n in args.tokens:
            for placement in args.placements:
                pages = dst_pages(n, placement, dst_np[0], dst_np[1], seed=n)
                offs, blocks = block_offsets(pool.spec, tuple(pool.spec.num_pages), dst_np, n, src_pages(n), pages)
                dev_offs = {g: (torch.from_numpy(s).to(dev), torch.from_numpy(d).to(dev)) for g, (s, d) in offs.items()}
                flat_src = {g: pool.pools[g].view(-1) for g in offs}
                flat_dst = {g: peer_pools[g].view(-1) for g in offs}
                idx = {g: (torch.from_numpy(s // BLOCK_ELEMS).to(dev), torch.from_numpy(d // BLOCK_ELEMS).to(args.devices[1]))
                       for g, (s, d) in offs.items()}

                def kernel() -> None:
                    for g, (s, d) in dev_offs.items():
                        _page_copy_kernel[(len(s), BLOCK_ELEMS // CHUNK)](flat_src[g], flat_dst[g], s, d,
                                                                          BLOCK=BLOCK_ELEMS, CHUNK=CHUNK, num_warps=4)

                def staged() -> None:
                    for g, (s, d) in idx.items():
                        src_blocks = pool.pools[g].view(-1, BLOCK_ELEMS)
                        dst_blocks = peer_pools[g].view(-1, BLOCK_ELEMS)
                        dst_blocks.index_copy_(0, d, src_blocks.index_select(0, s).to(args.devices[1]))

                for how, fn in (("kernel", kernel), ("staged", staged)):
                    times, ok, err = [], None, None
                    for _ in range(args.iters + 1):
                        q_to.put(("zero", tuple(pages.full), tuple(pages.ring), n, 0))
                        assert q_from.get(timeout=120)[0] == "zeroed"
                        sync()
                        t0 = time.perf_counter()
                        try:
                            fn()
                            sync()
                        except Exception as e:  # noqa: BLE001 - e.g. a launcher refusing peer pointers
                            err = f"{type(e).__name__}: {str(e)[:300]}"
                        times.append(time.perf_counter() - t0)
                        q_to.put(("check",))  # the decode side waits for it either way
                        got = q_from.get(timeout=120)
                        if got[0] == "error":
                            raise RuntimeError(got[1])
                        ok = got[1] if ok is None else (ok and got[1])
                        if err:
                            break
                    if err:
                        rows.append({"method": how, "tokens": n, "placement": placement, "error": err})
                        print(rows[-1], flush=True)
                        continue
                    ms = statistics.median(times[1:] if len(times) > 1 else times) * 1e3
                    nbytes = transfer_bytes(n, args.layers)
                    row = {"method": how, "tokens": n, "placement": placement, "blocks": blocks, "MB": nbytes / 1e6,
                           "ms": ms, "gbps": nbytes / ms / 1e6, "verified": bool(ok)}
                    rows.append(row)
                    print(row, flush=True)
    except Exception as e:  # noqa: BLE001 - unattended: record
        rows.append({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)})
    q_to.put(("stop",))
    result_q.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:1"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--placements", nargs="+", default=["contig", "runs16", "scattered"])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    ctx = tmp.get_context("spawn")
    q_to, q_from, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    nf = -(-max(args.tokens) // PAGE) * 2 + 64  # room for scattered placements
    dec = ctx.Process(target=decode_main, args=(args.devices[1], args.layers, nf, q_to, q_from), daemon=True)
    pre = ctx.Process(target=prefill_main, args=(args, q_to, q_from, result_q), daemon=True)
    dec.start()
    pre.start()
    try:
        rows = result_q.get(timeout=600)
    except Exception as e:  # noqa: BLE001
        rows = [{"error": f"no result: {type(e).__name__}: {e}"}]
    for p in (pre, dec):
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    env = {"torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "args": vars(args)}
    path = Path(os.environ.get("OUT", "out")) / "ipc_copy.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"{'method':7} {'tokens':>6} {'placement':9} {'blocks':>7} {'MB':>8} {'ms':>8} {'GB/s':>7} ok")
    for r in rows:
        if "error" in r:
            print("ERROR", r["error"], r.get("trace", ""))
            continue
        print(f"{r['method']:7} {r['tokens']:6d} {r['placement']:9} {r['blocks']:7d} {r['MB']:8.1f} {r['ms']:8.3f} "
              f"{r['gbps']:7.1f} {r['verified']}")


if __name__ == "__main__":
    main()
