"""KV transfer GPU0 -> GPU1 for gpt-oss-120b-shaped KV (36 layers, half sliding, 8 KV heads, d 64,
bf16 or e4m3 (--kv-cache-dtype fp8: half the bytes per request), page 16, window 128), on `nvidia-h200-x2`. Unattended: every section runs in try/except, a
short table is printed and everything goes to $OUT/kv_transfer.json.

Sections (one run):
  copy_p2p   plain `copy_` of one contiguous buffer of the same bytes GPU0 -> GPU1 (the ceiling)
  loopback   our LoopbackSender/Receiver (same process, gather -> P2P copy -> scatter per layer)
  nixl       our NixlSender (process on GPU0) -> NixlReceiver (process on GPU1), UCX defaults:
             all 36 layers posted back to back, timed from the accepted claim to DONE; decode
             page placements: contig (fresh allocator), runs16 (16-page runs), scattered (random)
  ipc        the same two processes with --kv-backend ipc: NIXL control plane, the bytes copied by
             a Triton kernel into the decode pool mapped through CUDA IPC (kv_transfer/ipc.py)
  overlap    per data path, the prefill-side cost when layer-overlapped: a stand-in prefill per
             layer (bf16 GEMMs of --prefill-gflop-per-token / 36 per token, then the layer's KV
             store), with and without the sender writing each layer as it completes; added time /
             compute time.
Every NIXL and loopback transfer the table reports was checked byte-exact on the decode side
(first timed iteration; the overlap run always), against a hash pattern of (layer, K/V, source
page, head, token, dim) that also proves each layer was written after its store completed.

    python -m benchmarks.kv_transfer [--tokens 8192 32768] [--iters 5] [--kv-cache-dtype fp8]
    python -m benchmarks.kv_transfer --devices cpu cpu --tokens 256 --layers 4 --iters 1 \
        --prefill-gflop-per-token 0.001  # CPU smoke (UCX_TLS=tcp UCX_NET_DEVICES=lo)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback
from pathlib import Path

import torch

from benchmarks.kv_layout import (HEADS, HEAD_DIM, HIDDEN, MODEL, PAGE, RING, WINDOW, dst_pages, fill_layer, make_spec,
                                  src_pages, transfer_bytes, verify)
from kv_transfer.interface import TransferConfig, TransferStatus
from kv_transfer.messages import TransferRequest, decode, encode
from kv_transfer.plan import GroupGeometry, head_runs, layer_copies, page_pairs
from model.kv_cache import KV_DTYPES, KVPool, PageGroup, SeqPages

WAIT = 120.0
KV_ELT = {"bf16": 2, "fp8": 1}

def sync(devices: list[str]) -> None:
    for d in devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


# ---- in-process baselines ---------------------------------------------------------------------
def bench_copy(args: argparse.Namespace, n: int) -> dict:
    nbytes = transfer_bytes(n, args.layers, KV_ELT[args.kv_cache_dtype])
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=args.devices[0])
    dst = torch.empty(nbytes, dtype=torch.uint8, device=args.devices[1])
    times = []
    for i in range(args.iters + 2):
        sync(args.devices)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(args.devices)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    assert torch.equal(dst.cpu(), src.cpu()) if nbytes < (1 << 26) else torch.equal(dst[:1 << 20].to(src.device), src[:1 << 20])
    ms = statistics.median(times) * 1e3
    return {"tokens": n, "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "gbps_best": nbytes / min(times) / 1e9}


def bench_loopback(args: argparse.Namespace, n: int, placement: str) -> dict:
    from kv_transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
    nf = -(-n // PAGE)
    dt = KV_DTYPES[args.kv_cache_dtype]
    pspec, dspec = make_spec(args.layers, nf, RING, dt), make_spec(args.layers, 2 * nf, 8 * RING, dt)
    ppool, dpool = KVPool(pspec, args.devices[0]), KVPool(dspec, args.devices[1])
    for layer in range(args.layers):
        fill_layer(ppool, layer, 0)
    hub = LoopbackHub()
    rx = LoopbackReceiver(dpool, TransferConfig("bench-dec", MODEL), hub)
    tx = LoopbackSender(ppool, TransferConfig("bench-pre", MODEL), hub)
    times, ok = [], None
    for it in range(args.iters + 1):
        pages = dst_pages(n, placement, dspec.num_pages[0], dspec.num_pages[1], seed=it)
        rid = f"lb-{n}-{placement}-{it}"
        tx.start(rx.expect(rid, pages, n, time.time() + WAIT), src_pages(n))
        sync(args.devices)
        t0 = time.perf_counter()
        for layer in range(args.layers):
            tx.layer_done(layer)
        sync(args.devices)
        times.append(time.perf_counter() - t0)
        assert tx.poll(rid) == rx.poll(rid) == TransferStatus.DONE
        nbytes = tx.finish(rid).num_bytes
        rx.finish(rid)
        if it == 1:
            ok = verify(dpool, pages, n, 0)
    ms = statistics.median(times[1:]) * 1e3
    return {"tokens": n, "placement": placement, "bytes": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6, "verified": ok}


# ---- NIXL: one process per GPU ------------------------------------------------------------------
def _set_device(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))


def decode_proc(args: argparse.Namespace, cmd_q, req_q, done_q, data_path: str) -> None:
    try:
        _decode_loop(args, cmd_q, req_q, done_q, data_path)
    except Exception as e:  # noqa: BLE001 - report to the prefill process instead of hanging it
        done_q.put(("error", f"decode process: {type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"))


def _decode_loop(args: argparse.Namespace, cmd_q, req_q, done_q, data_path: str) -> None:
    from kv_transfer.nixl_receiver import NixlReceiver
    dev = args.devices[1]
    _set_device(dev)
    nf_max = -(-max(args.tokens) // PAGE)
    pool = KVPool(make_spec(args.layers, 2 * nf_max, 8 * RING, KV_DTYPES[args.kv_cache_dtype]), dev)
    rx = NixlReceiver(pool, TransferConfig("bench-dec", MODEL, probe_interval_s=1.0), data_path=data_path)
    done_q.put(("ready", pool.spec.num_pages))
    active: dict[str, tuple[SeqPages, int, int, bool]] = {}
    while True:
        cmd = None if cmd_q.empty() else cmd_q.get()
        if cmd == "stop":
            break
        if cmd is not None:
            rid, n, full, ring, salt, check = cmd
            pages = SeqPages(full, ring)
            req_q.put(encode(rx.expect(rid, pages, n, time.time() + WAIT)))
            active[rid] = (pages, n, salt, check)
        for rid in list(active):
            st = rx.poll(rid)
            if st.terminal:
                pages, n, salt, check = active.pop(rid)
                ok = verify(pool, pages, n, salt) if check and st == TransferStatus.DONE else None
                out = rx.finish(rid) if st == TransferStatus.DONE else rx.outcome(rid)
                rx.take_releasable()
                done_q.put((rid, st.name, ok, out.detail))
    rx.close()


class DecodeDied(RuntimeError):
    pass


def _from_decode(done_q) -> tuple:
    msg = done_q.get(timeout=WAIT)
    if msg[0] == "error":
        raise DecodeDied(msg[1])
    return msg


def prefill_proc(args: argparse.Namespace, cmd_q, req_q, done_q, result_q, data_path: str) -> None:
    try:
        result_q.put(_prefill_run(args, cmd_q, req_q, done_q, data_path))
    except Exception as e:  # noqa: BLE001 - the main process records it
        result_q.put([{"section": data_path, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)}])
        cmd_q.put("stop")


def _prefill_run(args: argparse.Namespace, cmd_q, req_q, done_q, data_path: str) -> list[dict]:
    from kv_transfer.nixl_sender import NixlSender
    dev = args.devices[0]
    _set_device(dev)
    _, dnum = _from_decode(done_q)
    nf_max = -(-max(args.tokens) // PAGE)
    pool = KVPool(make_spec(args.layers, nf_max, RING, KV_DTYPES[args.kv_cache_dtype]), dev)
    for layer in range(args.layers):
        fill_layer(pool, layer, 0)
    tx = NixlSender(pool, TransferConfig("bench-pre", MODEL, max_layers_ahead=2), data_path=data_path)
    rows, counter = [], [0]

    def one(n: int, pages: SeqPages, salt: int, check: bool, per_layer=None) -> dict:
        counter[0] += 1
        rid = f"x{counter[0]}"
        cmd_q.put((rid, n, pages.full, pages.ring, salt, check))
        tx.start(decode(req_q.get(timeout=WAIT), TransferRequest), src_pages(n))
        end = time.monotonic() + WAIT
        while tx.poll(rid) == TransferStatus.WAITING and time.monotonic() < end:
            pass  # handshake (first time) and claim: done during the first layer in a real prefill
        sync([dev])
        t0 = time.perf_counter()
        for layer in range(args.layers):
            if per_layer is not None:
                per_layer(layer)
            tx.layer_done(layer)
        t_post = time.perf_counter() - t0
        while not tx.poll(rid).terminal and time.monotonic() < end:
            pass
        t1 = time.perf_counter() - t0
        out = tx.finish(rid)
        got = _from_decode(done_q)
        assert got[0] == rid, got
        return {"status": out.status.name, "detail": out.detail, "bytes": out.num_bytes, "s": t1, "post_s": t_post,
                "verified": got[2], "decode_status": got[1], "path": sorted(set(tx.data_paths.values()))}

    def section(name: str, fn) -> None:
        if any(r.get("decode_died") for r in rows):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - unattended: record and go on
            rows.append({"section": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=5),
                         "decode_died": isinstance(e, DecodeDied)})

    def bandwidth() -> None:
        for n in args.tokens:
            for placement in args.placements:
                runs = []
                for it in range(args.iters + 1):  # the first run also pays the handshake
                    pages = dst_pages(n, placement, dnum[0], dnum[1], seed=1000 * n + it)
                    runs.append(one(n, pages, 0, check=(it == 1)))
                timed = runs[1:]
                ms = statistics.median(r["s"] for r in timed) * 1e3
                rows.append({"section": data_path, "tokens": n, "placement": placement, "bytes": timed[0]["bytes"],
                             "descs_per_full_layer": _descs(n, placement, dnum), "ms": ms,
                             "gbps": timed[0]["bytes"] / ms / 1e6,
                             "gbps_best": timed[0]["bytes"] / min(r["s"] for r in timed) / 1e9,
                             "post_ms": statistics.median(r["post_s"] for r in timed) * 1e3,
                             "status": sorted({r["status"] for r in runs}), "verified": timed[0]["verified"],
                             "first_run_ms": runs[0]["s"] * 1e3, "path_used": runs[-1]["path"]})

    def overlap() -> None:
        for n in args.tokens:
            x = torch.randn(n, HIDDEN, device=dev, dtype=torch.bfloat16)
            w = torch.randn(HIDDEN, 2 * HIDDEN, device=dev, dtype=torch.bfloat16)
            y = torch.empty(n, 2 * HIDDEN, device=dev, dtype=torch.bfloat16)
            # 0 GEMMs when the flag is tiny: one [T, 2880] x [2880, 5760] bf16 GEMM takes minutes on a CPU
            reps = round(args.prefill_gflop_per_token * 1e9 / args.layers / (2 * HIDDEN * 2 * HIDDEN))

            def layer_compute(salt: int):
                def run(layer: int) -> None:
                    for _ in range(reps):
                        torch.matmul(x, w, out=y)
                    fill_layer(pool, layer, salt)  # the layer's KV store, after its compute
                return run

            compute = []
            for salt in (1, 2, 3):
                run = layer_compute(salt)
                sync([dev])
                t0 = time.perf_counter()
                for layer in range(args.layers):
                    run(layer)
                sync([dev])
                compute.append(time.perf_counter() - t0)
            tc = statistics.median(compute)
            for placement in args.placements:
                both = [one(n, dst_pages(n, placement, dnum[0], dnum[1], seed=7 + s), s, True, layer_compute(s))
                        for s in (4, 5, 6)]
                to = statistics.median(r["s"] for r in both)
                bw = [r for r in rows if r.get("section") == data_path and r["tokens"] == n and r["placement"] == placement]
                rows.append({"section": "overlap", "path": data_path, "tokens": n, "placement": placement,
                             "gemm_reps_per_layer": reps, "path_used": both[-1]["path"],
                             "compute_ms": tc * 1e3, "overlapped_ms": to * 1e3, "added_ms": (to - tc) * 1e3,
                             "added_share": (to - tc) / tc, "serial_share": (bw[0]["ms"] / 1e3 / tc) if bw else None,
                             "standin_tflops": args.prefill_gflop_per_token * 1e9 * n / tc / 1e12,
                             "verified": all(r["verified"] for r in both), "status": sorted({r["status"] for r in both})})

    section(data_path, bandwidth)
    section("overlap", overlap)
    cmd_q.put("stop")
    tx.close()
    return rows


def _descs(n: int, placement: str, dnum: tuple[int, int]) -> int:
    """WRITE descriptors of one full-attention layer (K and V), as the sender builds them."""
    spec_d = make_spec(2, dnum[0], dnum[1])
    pages = dst_pages(n, placement, dnum[0], dnum[1], seed=0)
    geo_s = GroupGeometry(1, -(-n // PAGE), HEADS, PAGE, HEAD_DIM, 2)
    geo_d = GroupGeometry(1, spec_d.num_pages[0], HEADS, PAGE, HEAD_DIM, 2)
    pairs = page_pairs(PageGroup.FULL, src_pages(n), pages, n, PAGE, WINDOW, geo_s.num_pages, geo_d.num_pages)
    return len(layer_copies(geo_s, geo_d, 0, pairs, head_runs(HEADS, 0, 1, 1)[0]))


def bench_nixl(args: argparse.Namespace, data_path: str) -> list[dict]:
    """One decode and one prefill process whose sender/receiver use `data_path` ("nixl" | "ipc")."""
    ctx = mp.get_context("spawn")
    cmd_q, req_q, done_q, result_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=decode_proc, args=(args, cmd_q, req_q, done_q, data_path), daemon=True),
             ctx.Process(target=prefill_proc, args=(args, cmd_q, req_q, done_q, result_q, data_path), daemon=True)]
    for p in procs:
        p.start()
    try:
        return result_q.get(timeout=args.nixl_timeout)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:1"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--placements", nargs="+", default=["contig", "runs16", "scattered"])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prefill-gflop-per-token", type=float, default=10.4, help="120b at 8k (DESIGN.md)")
    ap.add_argument("--data-paths", nargs="+", default=["nixl", "ipc"], choices=["nixl", "ipc"],
                    help="sender/receiver data paths to measure, each in its own pair of processes")
    ap.add_argument("--nixl-timeout", type=float, default=420.0, help="per data path")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="page dtype on both sides (fp8: e4m3, half the bytes per request)")
    args = ap.parse_args()
    report: dict = {"args": vars(args), "ucx_env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
                    "torch": torch.__version__, "errors": []}
    rows: list[dict] = []

    def section(name: str, fn) -> None:
        t0 = time.time()
        try:
            out = fn()
            rows.extend(out if isinstance(out, list) else [out])
            print(f"[kv_transfer] {name}: ok ({time.time() - t0:.1f}s)", flush=True)
        except Exception as e:  # noqa: BLE001 - unattended: record and go on
            report["errors"].append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}")
            print(f"[kv_transfer] FAILED {name}: {e}", flush=True)

    for n in args.tokens:
        section(f"copy_p2p {n}", lambda n=n: {"section": "copy_p2p", **bench_copy(args, n)})
    for n in args.tokens:
        for placement in ("contig", "scattered"):
            section(f"loopback {n} {placement}",
                    lambda n=n, p=placement: {"section": "loopback", **bench_loopback(args, n, p)})
    if args.devices[0].startswith("cuda"):
        torch.cuda.empty_cache()
    for dp in args.data_paths:
        section(f"{dp} + overlap (2 processes)", lambda dp=dp: bench_nixl(args, dp))
    for r in rows:
        if "error" in r:
            report["errors"].append(f"{r['section']}: {r['error']}\n{r.get('trace', '')}")
    report["rows"] = [r for r in rows if "error" not in r]
    _print_table(report["rows"])
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    name = "kv_transfer.json" if args.kv_cache_dtype == "bf16" else f"kv_transfer_{args.kv_cache_dtype}.json"
    report["bytes_per_request"] = {n: transfer_bytes(n, args.layers, KV_ELT[args.kv_cache_dtype]) for n in args.tokens}
    (out / name).write_text(json.dumps(report, indent=1, default=str))
    print(f"bytes per request ({args.kv_cache_dtype} pages): " +
          ", ".join(f"{n} tokens {b / 2**20:.1f} MiB" for n, b in report["bytes_per_request"].items()))
    print(f"wrote {out / name}; {len(report['errors'])} error(s)")
    for e in report["errors"]:
        print("ERROR", e.splitlines()[0])


def _print_table(rows: list[dict]) -> None:
    print(f"{'section':9} {'tokens':>6} {'placement':9} {'MB':>8} {'descs/L':>7} {'ms':>8} {'GB/s':>7} {'post ms':>7} ok")
    for r in rows:
        if r["section"] == "overlap":
            print(f"{'ovl ' + r['path']:9} {r['tokens']:6d} {r.get('placement', '-'):9} compute {r['compute_ms']:.1f} ms, overlapped {r['overlapped_ms']:.1f} ms: "
                  f"+{r['added_ms']:.2f} ms = {100 * r['added_share']:.2f}% (serial would be "
                  f"{100 * (r['serial_share'] or float('nan')):.2f}%), stand-in {r['standin_tflops']:.0f} TFLOP/s, "
                  f"verified={r['verified']}")
            continue
        print(f"{r['section']:9} {r['tokens']:6d} {r.get('placement', '-'):9} {r['bytes'] / 1e6:8.1f} "
              f"{r.get('descs_per_full_layer', '-')!s:>7} {r['ms']:8.3f} {r['gbps']:7.1f} "
              f"{r.get('post_ms', float('nan')):7.2f} {r.get('verified', '-')}")


if __name__ == "__main__":
    main()
