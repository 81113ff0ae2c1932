"""Where a NIXL WRITE spends its time, GPU0 -> GPU1 VRAM over UCX (cuda_ipc), two processes.

For a fixed 256 MiB payload split into N descriptors (N = 1 .. 4096), with NIXL's progress thread
on and off, each API step is timed on the host: building descriptor lists (`get_xfer_descs` from
numpy), `initialize_xfer`, `transfer` (post), polling `check_xfer_state` until DONE; plus the
prepped path (`prep_xfer_dlist` once, then `make_prepped_xfer` with index lists). The destination
bytes are verified once per configuration. This tells kv_transfer/ which lever matters: descriptor
count, per-WRITE overhead, or the copy itself.

    python -m benchmarks.nixl_probe            # on nvidia-h200-x2; writes $OUT/nixl_probe.json
    UCX_TLS=tcp UCX_NET_DEVICES=lo python -m benchmarks.nixl_probe --devices cpu cpu --payload-mib 8 --reps 1
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

import numpy as np
import torch

from kv_transfer.nixl_backend import descriptors

BUF = 1 << 30


def _descs(base: int, n: int, size: int, dev: int, stride: int) -> np.ndarray:
    """n descriptors of `size` bytes, `stride` apart from `base` (the sender's descriptor format)."""
    return descriptors(base, np.arange(n, dtype=np.int64) * stride, np.full(n, size, dtype=np.int64), dev)


def _setup(dev: str) -> tuple[str, int]:
    """(NIXL memory type, device id); GPU processes also bind their device."""
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
        return "VRAM", torch.device(dev).index
    return "DRAM", 0


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def target(dev: str, q_meta, q_ctl, prog: bool) -> None:
    import nixl._api as api
    _, dev_id = _setup(dev)
    buf = torch.zeros(BUF, dtype=torch.uint8, device=dev)
    agent = api.nixl_agent(f"tgt-{prog}", api.nixl_agent_config(enable_prog_thread=prog, backends=["UCX"]))
    agent.register_memory(buf)
    q_meta.put((agent.get_agent_metadata(), buf.data_ptr(), dev_id))
    import queue
    while True:
        try:  # without a progress thread the target must drive its own UCX worker
            cmd = q_ctl.get(timeout=0.001)
        except queue.Empty:
            agent.get_new_notifs()
            continue
        if cmd == "stop":
            break
        # cmd = (n, stride): return a checksum of what landed in the first n descriptors' ranges
        n, stride, size = cmd
        _sync(dev)
        v = buf.view(-1)
        idx = torch.arange(n, device=dev) * stride
        first = v[idx].to(torch.int64).sum().item()
        last = v[idx + size - 1].to(torch.int64).sum().item()
        q_meta.put((first, last))
        agent.get_new_notifs()


def initiator(dev: str, q_meta, q_ctl, prog: bool, result_q, reps: int, payload: int) -> None:
    import nixl._api as api
    rows = []
    try:
        mem, ldev = _setup(dev)
        buf = torch.empty(BUF, dtype=torch.uint8, device=dev)
        agent = api.nixl_agent(f"ini-{prog}", api.nixl_agent_config(enable_prog_thread=prog, backends=["UCX"]))
        agent.register_memory(buf)
        meta, rbase, rdev = q_meta.get(timeout=120)
        remote = agent.add_remote_agent(meta)
        for n in (1, 2, 8, 64, 512, 4096):
            size = payload // n
            stride = 2 * size if n > 1 else size  # gaps between ranges: nothing can be merged
            if (n - 1) * stride + size > BUF:
                stride = size
            buf.fill_(n % 251 + 1)
            _sync(dev)
            t = {"get_descs": [], "init": [], "post": [], "wait": [], "checks": [], "total": []}
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                ld = agent.get_xfer_descs(_descs(buf.data_ptr(), n, size, ldev, stride), mem)
                rd = agent.get_xfer_descs(_descs(rbase, n, size, rdev, stride), mem)
                t1 = time.perf_counter()
                h = agent.initialize_xfer("WRITE", ld, rd, remote, b"probe")
                t2 = time.perf_counter()
                st = agent.transfer(h)
                t3 = time.perf_counter()
                checks = 0
                while st != "DONE":
                    st = agent.check_xfer_state(h)
                    checks += 1
                    assert st != "ERR"
                t4 = time.perf_counter()
                h.release()
                for k, v in (("get_descs", t1 - t0), ("init", t2 - t1), ("post", t3 - t2), ("wait", t4 - t3),
                             ("checks", checks), ("total", t4 - t0)):
                    t[k].append(v)
            q_ctl.put((n, stride, size))
            first, last = q_meta.get(timeout=60)
            ok = first == last == n * (n % 251 + 1)
            med = {k: statistics.median(v[1:]) for k, v in t.items()}
            row = {"mode": "initialize_xfer", "prog_thread": prog, "descs": n, "desc_bytes": size, "verified": ok,
                   **{f"{k}_us": round(v * 1e6, 1) for k, v in med.items() if k != "checks"},
                   "checks": med["checks"], "gbps": round(payload / med["total"] / 1e9, 1)}
            rows.append(row)
            print(row, flush=True)
            # prepped: descriptor lists made once, transfers by index
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(buf.data_ptr(), n, size, ldev, stride), mem)
            rp = agent.prep_xfer_dlist(remote, _descs(rbase, n, size, rdev, stride), mem)
            idx = np.arange(n, dtype=np.int64)
            tt = {"make": [], "post": [], "wait": [], "total": []}
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("WRITE", lp, idx, rp, idx, b"probe")
                t1 = time.perf_counter()
                st = agent.transfer(h)
                t2 = time.perf_counter()
                while st != "DONE":
                    st = agent.check_xfer_state(h)
                    assert st != "ERR"
                t3 = time.perf_counter()
                h.release()
                for k, v in (("make", t1 - t0), ("post", t2 - t1), ("wait", t3 - t2), ("total", t3 - t0)):
                    tt[k].append(v)
            med = {k: statistics.median(v[1:]) for k, v in tt.items()}
            row = {"mode": "prepped", "prog_thread": prog, "descs": n, "desc_bytes": size,
                   **{f"{k}_us": round(v * 1e6, 1) for k, v in med.items()},
                   "gbps": round(payload / med["total"] / 1e9, 1)}
            rows.append(row)
            print(row, flush=True)
            agent.release_dlist_handle(lp)
            agent.release_dlist_handle(rp)
        # the sender's pattern: 36 WRITEs of 2 descriptors (one layer's K and V) posted back to back,
        # each polled once per post (as progress() does), then all waited out
        for size in (payload // 64, payload // 16):
            tt = {"post": [], "total": []}
            for _ in range(reps + 1):
                hs = []
                t0 = time.perf_counter()
                for layer in range(36):
                    base = layer * 2 * size
                    ld = agent.get_xfer_descs(_descs(buf.data_ptr() + base, 2, size, ldev, size), mem)
                    rd = agent.get_xfer_descs(_descs(rbase + base, 2, size, rdev, size), mem)
                    h = agent.initialize_xfer("WRITE", ld, rd, remote, b"layer")
                    agent.transfer(h)
                    hs.append(h)
                    for x in hs:
                        agent.check_xfer_state(x)
                t1 = time.perf_counter()
                for x in hs:
                    while agent.check_xfer_state(x) != "DONE":
                        pass
                t2 = time.perf_counter()
                for x in hs:
                    x.release()
                tt["post"].append(t1 - t0)
                tt["total"].append(t2 - t0)
            med = {k: statistics.median(v[1:]) for k, v in tt.items()}
            row = {"mode": "36 layer writes", "prog_thread": prog, "descs": 72, "desc_bytes": size,
                   "post_us": round(med["post"] * 1e6, 1), "wait_us": round((med["total"] - med["post"]) * 1e6, 1),
                   "gbps": round(72 * size / med["total"] / 1e9, 1)}
            rows.append(row)
            print(row, flush=True)
    except Exception as e:  # noqa: BLE001 - unattended: report
        rows.append({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)})
    q_ctl.put("stop")
    result_q.put(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:1"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--payload-mib", type=int, default=256)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = {"env": {"torch": torch.__version__,
                   "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   "ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
                   "date": time.strftime("%Y-%m-%d")}, "rows": []}
    for prog in (True, False):
        q_meta, q_ctl, res = ctx.Queue(), ctx.Queue(), ctx.Queue()
        tp = ctx.Process(target=target, args=(a.devices[1], q_meta, q_ctl, prog))
        ip = ctx.Process(target=initiator, args=(a.devices[0], q_meta, q_ctl, prog, res, a.reps,
                                                          a.payload_mib << 20))
        tp.start()
        ip.start()
        try:
            out["rows"] += res.get(timeout=300)
        except Exception as e:  # noqa: BLE001
            out["rows"].append({"error": f"prog={prog}: {type(e).__name__}: {e}"})
        for p in (ip, tp):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    path = Path(os.environ.get("OUT", "out")) / "nixl_probe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"{'mode':16} {'prog':5} {'descs':>5} {'us/desc':>8} {'init/make':>9} {'post':>8} {'wait':>8} {'GB/s':>6} ok")
    for r in out["rows"]:
        if "error" in r:
            print("ERROR", r["error"])
            continue
        print(f"{r['mode']:16} {str(r['prog_thread']):5} {r['descs']:>5} {r.get('get_descs_us', 0) / r['descs']:8.2f} "
              f"{r.get('init_us', r.get('make_us', 0)):9.1f} {r['post_us']:8.1f} {r['wait_us']:8.1f} {r['gbps']:6.1f} "
              f"{r.get('verified', '-')}")


if __name__ == "__main__":
    main()
