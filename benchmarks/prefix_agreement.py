"""Prefix caching: is a cached engine's disagreement with an uncached one rounding noise or a bug?
(issue 25; CPU or GPU; the GPU test tests/integration/test_prefix_cache_gpu.py runs `compare`).

Three engines run the same multi-turn conversations (a shared system prompt, new user tokens each
turn, greedy answers; every conversation continues with the reference's answers, so all engines see
the same prompts every turn):
  * `off`: no prefix cache, the reference;
  * `on`: the prefix cache (later turns compute only their new tokens);
  * `ctl`: no prefix cache and another chunk size (max_num_batched_tokens / 2): the same computation
    as `off` split into other GEMM row counts and attention chunks. Its distance to `off` is the
    noise floor of the dtype and kernels; `on` differs from `off` in exactly those ways too (its
    prefix KV was computed in other chunks, its suffix in another batch), plus whatever the cached
    path could get wrong (page mapping, sliding-ring copies, attention over a cached prefix).

Measured per engine against `off`:
  * tokens: greedy agreement up to the first mismatch; each first mismatch is *explained* when
    `off` itself nearly tied there (its logprob of the engine's token within `tie` of its top-1);
  * first-token logits (the prefill step's, eager): max |d| / std(logits of off), argmax agreement;
  * KV of each finished sequence over the positions both engines hold for it, per layer (full-
    attention layers: every position; sliding layers: the ring's valid tail), relative error
    |d| / |ref| of K and V, for `on` split at its prefix hit (positions < hit were read from the
    cache, the rest computed this turn).
A bug shows as an `on` error far above `ctl`'s in some layer / group / segment (where it starts is
where to look), or as unexplained token mismatches; bf16 noise keeps `on` at `ctl`'s level.

CPU: `python -m benchmarks.prefix_agreement --dtype bfloat16 --attention torch` (the `tiny-wide`
preset: real vocabulary, head_dim, GQA ratio, window and page size; small hidden size).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

TURNS, CONVS, MAX_TOKENS = 4, 4, 12


@dataclass(slots=True)
class Probe:
    """What one engine records while it runs: first-token logits and KV at finish, per request."""

    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> [V] fp32 (host)
    kv: dict[str, tuple[list[int], dict[int, tuple[int, torch.Tensor]]]] = field(default_factory=dict)
    hit: dict[str, int] = field(default_factory=dict)  # request id -> cached prefix tokens


def attach(llm) -> Probe:
    """Hook an LLM's runner (first-token logits of eager steps) and scheduler (KV at finish)."""
    eng, probe = llm.engine, Probe()
    runner, sched = eng.runner, eng.scheduler
    launch0, forward0, finish0 = runner.launch, runner.forward, sched.finish
    state: dict = {}

    def launch(items, prev=None, no=0, on_layer_done=None):
        state["items"] = items
        return launch0(items, prev, no, on_layer_done)

    def forward(input_ids, steps, rows, on_layer_done=None, want_logits=True, **kw):
        out = forward0(input_ids, steps, rows, on_layer_done, want_logits, **kw)
        items = state.get("items")
        if out is not None and items is not None and len(items) == len(steps):
            for r, i in enumerate(rows):
                seq = items[i].seq
                if not seq.output_ids and not seq.num_pending:
                    probe.logits[seq.request_id] = out[r].float().cpu()
        return out

    def finish(seq, reason):
        from engine.sequence import SeqStatus
        if seq.status == SeqStatus.RUNNING and seq.request_id not in probe.kv:
            probe.kv[seq.request_id] = (list(seq.all_ids), snapshot_kv(eng, seq))
            probe.hit[seq.request_id] = seq.num_cached_prefix
        finish0(seq, reason)

    runner.launch, runner.forward, sched.finish = launch, forward, finish
    return probe


def snapshot_kv(eng, seq) -> dict[int, tuple[int, torch.Tensor]]:
    """layer -> (first position, K/V [2, n, Hkv, D] in the pool's dtype on its device) of the
    positions the sequence's pages hold valid KV for: all of them in full layers, the ring's tail
    (from ring_valid_from, last R blocks) in sliding layers."""
    from model.kv_cache import PageGroup

    spec, pool = eng.kv.spec, eng.runner.pool
    p, r = spec.page_size, spec.ring_pages
    n = min(seq.num_cached, seq.num_tokens)
    out = {}
    if n <= 0:
        return out
    if spec.full_layers and seq.pages.full:
        pages = torch.tensor(seq.pages.full[: -(-n // p)], device=pool.pools[0].device)
        kv = pool.pools[PageGroup.FULL].index_select(2, pages)  # [L, 2, np, Hkv, P, D]
        kv = kv.permute(0, 1, 2, 4, 3, 5).flatten(2, 3)[:, :, :n]  # [L, 2, n, Hkv, D]
        for i, layer in enumerate(spec.full_layers):
            out[layer] = (0, kv[i].clone())
    if spec.sliding_layers and seq.pages.ring and not seq.pages.copy_src:
        last = (n - 1) // p
        lo = max(seq.ring_valid_from, (last - r + 1) * p, 0)
        dev = pool.pools[PageGroup.SLIDING].device
        pos = torch.arange(lo, n)
        pages = torch.tensor(seq.pages.ring)[(pos // p) % r].to(dev)
        # [L, 2, NP, Hkv, P, D] indexed at (page, offset) per position -> [N, L, 2, Hkv, D]
        kv = pool.pools[PageGroup.SLIDING][:, :, pages, :, (pos % p).to(dev)].permute(1, 2, 0, 3, 4)
        for i, layer in enumerate(spec.sliding_layers):
            out[layer] = (lo, kv[i].clone())
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass(slots=True)
class Errors:
    """Worst relative errors seen, keyed (layer, group name, segment)."""

    kv: dict[tuple[int, str, str], float] = field(default_factory=dict)
    logits_rel: float = 0.0  # max |d logits| / std(reference logits), over first tokens
    logits_abs: float = 0.0  # max |d logits| (logit units: the scale of a near-tie's margin)
    argmax_flips: int = 0
    first_tokens: int = 0
    agree: int = 0
    total: int = 0
    mismatches: list[dict] = field(default_factory=list)  # each first mismatch: position, margins

    def note_kv(self, key: tuple[int, str, str], err: float) -> None:
        self.kv[key] = max(self.kv.get(key, 0.0), err)

    def worst(self, group: str | None = None, segment: str | None = None) -> float:
        vals = [v for (l, g, s), v in self.kv.items() if (group is None or g == group) and (segment is None or s == segment)]
        return max(vals, default=0.0)

    @property
    def unexplained(self) -> list[dict]:
        return [m for m in self.mismatches if not m["tie"]]

    def beyond(self, tie: float) -> list[dict]:
        """First mismatches where neither engine's margin between the two tokens is within `tie`."""
        return [m for m in self.mismatches if min(m["off_margin"], m["engine_margin"]) > tie]

    def summary(self) -> dict:
        return {"agree": self.agree, "total": self.total, "agreement": round(self.agree / max(self.total, 1), 3),
                "mismatches": len(self.mismatches), "unexplained_mismatches": len(self.unexplained),
                "first_token_logits_rel_err": round(self.logits_rel, 5),
                "first_token_logits_max_abs_diff": round(self.logits_abs, 5), "first_token_argmax_flips": self.argmax_flips,
                "first_tokens": self.first_tokens,
                "kv_rel_err": {f"L{l} {g} {s}": round(v, 6) for (l, g, s), v in sorted(self.kv.items())},
                "mismatch_detail": self.mismatches}


def compare_kv(err: Errors, ref: tuple[list[int], dict], got: tuple[list[int], dict], hit: int,
               sliding_layers: tuple[int, ...]) -> None:
    """Relative K/V errors over positions both sequences hold with the same tokens before them."""
    ref_ids, ref_kv = ref
    got_ids, got_kv = got
    same = _common_prefix(ref_ids, got_ids)
    for layer, (lo_r, a) in ref_kv.items():
        if layer not in got_kv:
            continue
        lo_g, b = got_kv[layer]
        lo, hi = max(lo_r, lo_g), min(lo_r + a.shape[1], lo_g + b.shape[1], same)
        group = "sliding" if layer in sliding_layers else "full"
        for seg, (s0, s1) in (("cached", (lo, min(hi, hit))), ("computed", (max(lo, hit), hi))):
            if s1 <= s0:
                continue
            x = a[:, s0 - lo_r:s1 - lo_r].float()
            y = b[:, s0 - lo_g:s1 - lo_g].float()
            for kv_i, name in ((0, "K"), (1, "V")):
                d = (y[kv_i] - x[kv_i]).norm() / x[kv_i].norm().clamp_min(1e-30)
                err.note_kv((layer, group, f"{name} {seg}"), float(d))


def compare_tokens(err: Errors, ref, got, tie: float) -> None:
    """Agreement up to the first mismatch; a mismatch is a tie when off's logprob of the engine's
    token is within `tie` of off's top-1 (or the engine's logprob of off's token within `tie` of its top-1)."""
    i = _common_prefix(ref.output_ids, got.output_ids)
    err.agree += i
    err.total += len(ref.output_ids)
    if i == len(ref.output_ids):
        return
    r_lp, g_lp = ref.logprobs[i], got.logprobs[i]
    r_top, g_top = dict(r_lp.top), dict(g_lp.top)
    m_ref = r_lp.logprob - r_top.get(got.output_ids[i], -math.inf)  # off: its token vs the engine's
    m_got = g_lp.logprob - g_top.get(ref.output_ids[i], -math.inf)
    err.mismatches.append({"pos": i, "off_margin": round(m_ref, 4), "engine_margin": round(m_got, 4),
                           "tie": min(m_ref, m_got) <= tie})


def compare_logits(err: Errors, ref: torch.Tensor, got: torch.Tensor) -> None:
    err.first_tokens += 1
    d = float((got - ref).abs().max())
    err.logits_abs = max(err.logits_abs, d)
    err.logits_rel = max(err.logits_rel, d / float(ref.std().clamp_min(1e-30)))
    err.argmax_flips += int(got.argmax() != ref.argmax())


def run_conversations(engines: dict, *, system_len: int = 1500, turns: int = TURNS, convs: int = CONVS,
                      max_tokens: int = MAX_TOKENS, user_len: tuple[int, int] = (40, 30), vocab: int = 100_000,
                      tie: float = 0.25, seed: int = 0, on_turn=None) -> dict:
    """engines: name -> LLM, one named "off" (the reference). Returns {name: Errors} for the others,
    plus per-turn hit statistics of the engines with a prefix cache. `on_turn(turn, outputs)` is
    called after each turn (the GPU test checks hits there)."""
    from engine.sampling import SamplingParams

    probes = {name: attach(llm) for name, llm in engines.items()}
    errs = {name: Errors() for name in engines if name != "off"}
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1000, vocab, (system_len,), generator=g).tolist()
    prompts = [list(system) for _ in range(convs)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    sliding = engines["off"].engine.kv.spec.sliding_layers
    hits = []
    for turn in range(turns):
        for c in range(convs):
            prompts[c] += torch.randint(1000, vocab, (user_len[0] + user_len[1] * c,), generator=g).tolist()
        outs, seen = {}, {}
        for name, llm in engines.items():
            pr = probes[name]
            pr.logits.clear(), pr.kv.clear(), pr.hit.clear()
            outs[name] = llm.generate([list(p) for p in prompts], params)
            seen[name] = [(o, pr.logits.get(o.request_id), pr.kv.get(o.request_id), pr.hit.get(o.request_id, 0))
                          for o in outs[name]]
            pr.logits.clear(), pr.kv.clear()  # what `seen` holds is all that is kept (GPU memory)
        turn_hits = {name: [x[3] for x in rows] for name, rows in seen.items()}
        split = turn_hits.get("on", [0] * convs)  # segments at the cached engine's hit, for every engine
        for name, e in errs.items():
            for c, ((o, lg, kv, _), (r, r_lg, r_kv, _)) in enumerate(zip(seen[name], seen["off"])):
                compare_tokens(e, r, o, tie)
                if lg is not None and r_lg is not None:
                    compare_logits(e, r_lg, lg)
                if kv is not None and r_kv is not None:
                    compare_kv(e, r_kv, kv, split[c], sliding)
        del seen
        hits.append(turn_hits)
        if on_turn is not None:
            on_turn(turn, outs)
        for c, r in enumerate(outs["off"]):
            prompts[c] += r.output_ids
    return {"errors": errs, "hits": hits}


def verdict(errs: dict) -> dict:
    """`on` against the noise control `ctl`: ratios of the worst errors, per group."""
    on, ctl = errs["on"], errs["ctl"]
    out = {"agreement": {"on": on.summary()["agreement"], "ctl": ctl.summary()["agreement"]},
           "unexplained_mismatches": {"on": len(on.unexplained), "ctl": len(ctl.unexplained)},
           "first_token_logits_rel_err": {"on": on.logits_rel, "ctl": ctl.logits_rel}}
    for group in ("full", "sliding"):
        out[f"kv_rel_err_{group}"] = {"on": on.worst(group), "ctl": ctl.worst(group)}
    return out


def make_engines(device: str, dtype: str, attention: str, preset: str, layers: int | None, chunk: int,
                 fp8: bool, graphs: bool = False, linear: str = "torch", moe: str = "torch") -> dict:
    from engine.build import EngineConfig
    from engine.llm import LLM
    from engine.scheduler import SchedulerConfig

    def one(cache: bool, tokens: int):
        cfg = EngineConfig(random_preset=preset, random_layers=layers, device=device, dtype=dtype, fp8=fp8,
                           fp8_attention=False if fp8 else None, attention_backend=attention,
                           linear_backend=linear, moe_backend=moe, kv_cache_bytes=(4 << 30) if device != "cpu" else (64 << 20),
                           enable_prefix_caching=cache, cuda_graphs=graphs,  # decode graphs up to max_num_seqs
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=tokens, max_model_len=8192))
        return LLM(cfg)

    return {"off": one(False, chunk), "on": one(True, chunk), "ctl": one(False, chunk // 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--attention", default="torch", choices=["torch", "triton", "flashinfer"])
    ap.add_argument("--preset", default="tiny-wide")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--fp8", action="store_true", help="FP8 dense weights (the GPU test's setting)")
    ap.add_argument("--system-len", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=1024, help="off/on's max_num_batched_tokens; ctl gets half")
    ap.add_argument("--turns", type=int, default=TURNS)
    ap.add_argument("--user-len", default="40:30", help="BASE:STEP new tokens per turn, conversation c gets BASE + c*STEP")
    ap.add_argument("--tie", type=float, default=0.25)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    args = ap.parse_args()
    if args.attention == "triton" and args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the backends)
    torch.manual_seed(0)
    t0 = time.time()
    engines = make_engines(args.device, args.dtype, args.attention, args.preset, args.layers, args.chunk, args.fp8)
    base, step = (int(x) for x in args.user_len.split(":"))
    res = run_conversations(engines, system_len=args.system_len, turns=args.turns, user_len=(base, step),
                            tie=args.tie)
    report = {"args": vars(args), "seconds": round(time.time() - t0, 1), "hits": res["hits"],
              "verdict": verdict(res["errors"]), "engines": {k: e.summary() for k, e in res["errors"].items()}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
