"""Piecewise CUDA graphs for the eager forward steps (prefill chunks, mixed steps), vLLM's answer to
a host-launch-bound forward: a 352-token prefill of gpt-oss-20b took ~36 ms of wall time for
~11.7 ms of kernels (benchmarks/results/2026-12-03/prefill-prefix-1, -2), ~1.5 ms of Python per
layer launching ~11 Triton kernels, cuBLAS calls and allocations one by one.

A forward of L layers is cut at its attention calls into L + 1 pieces, each captured once per
token-count bucket; attention itself (RoPE + the K/V store + paged attention, which depend on the
step's page tables and sequence lengths) runs eagerly in between, on the real tokens only:

    piece 0      embed, layer 0's attention norm, QKV                        -> x, qkv
    island i     layer i's RoPE + K/V store + attention, then on_layer_done(i)  qkv -> o
    piece i      layer i-1's O projection (+ all-reduce), residual add + norm, MoE (router, experts,
                 all-reduce), layer i's residual add + attention norm, QKV      x, o -> x, qkv
    piece L      layer L-1's O projection and MoE, the final norm              x, o -> hidden

A step of T tokens runs the smallest bucket B >= T: its ids go into rows [0, T) of static buffers
shared by all buckets (a bucket uses their first B rows), rows [T, B) hold whatever an earlier
step left there (finite values: zeros at start-up, then real tokens' data). They never reach real
rows: every op in a piece is row-wise (embedding, norms, GEMMs, the per-token quantisation, the
all-reduce) except the MoE's grouping, where padded rows take their own (token, expert) pairs and
rows of capacity sized from B; an expert GEMM row is its own pair's, and the combine sums a token's
own pairs (tests/integration/test_piecewise.py checks the bits on the CPU with the grouped Triton MoE).
Per-call host decisions by token count (the MoE path and tile table, the router fusion, the FP8
input) are taken for B, fixed per bucket. The islands read only rows [0, T): padded rows store
no K/V.

Graphs are captured at start-up (build_engine_parts), not on a bucket's first use: a capture (a
warm-up of every piece, then L + 1 captures) would otherwise land on a request's TTFT, and at
start-up no other thread launches work (KV transfers) that a global-mode capture would trip on.
Buckets are captured largest first into one memory pool: a piece copies its outputs into the
static buffers, so its temporaries die with its capture and the next capture reuses them; pieces
never run concurrently. Without CUDA (tests) the pieces run directly on the same static buffers.
Steps above the largest bucket run the monolithic eager forward. Shapes: T real tokens, B bucket,
H hidden, Q = Hq D, N = (Hq + 2 Hkv) D.

With `graphed` page groups (--piecewise-graphed-attention sliding|all; all is a GPU decode worker's default) the
attention of those groups' layers is captured too (kernels/triton_graph_attention.py: RoPE, the store, the
Triton sink attention, on per-step tables at fixed addresses): `sliding` leaves the 12 full layers as islands
(12 + 13 pieces for gpt-oss instead of 24 + 25), `all` none (a step is one graph), the islands being most
of a mixed step's host launch. A piece then runs from one island's O projection through the absorbed layers
to the next island's QKV; on_layer_done(i) of an absorbed layer runs after its piece (before the next
island). Triton must run (a GPU, or the CPU interpreter).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from kernels.interface import StepMeta
from model.gpt_oss import GptOss
from model.kv_cache import KVPool, PageGroup
from model.labels import label

log = logging.getLogger("tandem.piecewise")

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# --piecewise-buckets fine (the default): 1.5x apart. A step pads to its bucket and the padded rows are real work
# in the MoE (they route to experts like any row): a ~300-token mixed step in the 512 bucket computes ~200 rows
# for nothing. colocated-buckets-ab-1 (H100, served multi-turn, one lease): mixed steps' GPU span 16.2 -> 15.1 ms,
# cached TTFT p50 39.9 -> 38.4 ms (p99 76 -> 62), the same graph pool (366 MiB). The decode graphs' batch buckets
# are spaced this way too (engine/decode_graphs.py).
FINE_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
BUCKET_SETS = {"pow2": DEFAULT_BUCKETS, "fine": FINE_BUCKETS}
# --piecewise-graphed-attention: the page groups whose layers' attention the pieces hold (module doc)
GRAPHED = {"none": frozenset(), "sliding": frozenset({PageGroup.SLIDING}), "all": frozenset(PageGroup)}


class PiecewiseSplit:
    """Two sets of pieces by step size (--piecewise-graphed-max-tokens): `small` (buckets up to a limit) with
    attention inside the graphs, `large` (the buckets above it) with attention as eager islands. A mixed step
    of a cached turn (a few hundred tokens) then launches as a few graphs, while a long prompt's chunk keeps
    FlashInfer's attention: launch-hold-bubble-ab-1 (H100) measured attention in the graphs at 7.6 vs 18.2 ms
    for a ~300-token mixed step's launch, but 51.9 vs 31.9 ms for a 4,096-token one. The runner sees one
    object with PiecewiseGraphs' interface."""

    def __init__(self, small: PiecewiseGraphs, large: PiecewiseGraphs) -> None:
        self.small, self.large = small, large
        self.buckets = small.buckets + large.buckets

    def _for(self, t: int) -> PiecewiseGraphs | None:
        if self.small.bucket(t) is not None:
            return self.small
        return self.large if self.large.bucket(t) is not None else None

    def bucket(self, t: int) -> int | None:
        pw = self._for(t)
        return None if pw is None else pw.bucket(t)

    def plan(self, step: StepMeta) -> None:
        pw = self._for(step.positions.shape[0])
        assert pw is not None, "a step without a bucket runs the eager forward"
        pw.plan(step)

    def run(self, input_ids: torch.Tensor, step: StepMeta, kv: KVPool | None,
            on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        pw = self._for(input_ids.shape[0])
        assert pw is not None, f"{input_ids.shape[0]} tokens: no bucket (the caller runs the eager forward)"
        return pw.run(input_ids, step, kv, on_layer_done)

    def parts(self) -> list[PiecewiseGraphs]:
        return [self.small, self.large]

    def capture(self) -> None:
        for pw in self.parts():
            pw.capture()

    def static_bytes(self) -> int:
        return sum(pw.static_bytes() for pw in self.parts())

    def pool_bytes(self) -> int:
        return sum(pw.pool_bytes() for pw in self.parts())


def buckets_for(max_tokens: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a step of at most `max_tokens` tokens can use (the engine's max batched tokens)."""
    return tuple(b for b in buckets if b <= max_tokens) or (max_tokens,)


class PiecewiseGraphs:
    def __init__(self, model: GptOss, buckets: tuple[int, ...] = DEFAULT_BUCKETS, *, pool: KVPool | None = None,
                 graphed: frozenset[PageGroup] = frozenset(), max_seqs: int = 0, max_model_len: int = 0) -> None:
        """graphed: page groups whose layers' attention is captured too (module doc), on the engine's KV
        `pool`; max_seqs and max_model_len bound a step's sequences and their views (the scheduler's)."""
        assert buckets and all(b > 0 for b in buckets)
        self.model = model
        self.buckets = tuple(sorted(set(buckets)))
        self.pool = pool if graphed else None
        layers = model.layers
        # layers whose attention runs eagerly between pieces; the others are inside them
        self.islands = [i for i, blk in enumerate(layers) if blk.attn.group not in graphed]
        self.num_pieces = len(self.islands) + 1
        self.tables: dict[PageGroup, object] = {}  # kernels.triton_graph_attention.GroupTables per graphed group
        self._planned: StepMeta | None = None
        if graphed:
            from kernels.triton_graph_attention import GroupTables, graph_configs, graph_splits

            assert pool is not None and max_seqs > 0 and max_model_len > 0
            spec = pool.spec
            a0 = layers[0].attn
            cfgs = graph_configs(a0.num_heads // a0.num_kv_heads, model.device)
            for g in graphed:
                sliding = g == PageGroup.SLIDING
                pages = spec.ring_pages if sliding else -(-max_model_len // spec.page_size)
                split = {} if sliding else graph_splits(a0.num_heads // a0.num_kv_heads, a0.num_kv_heads, cfgs,
                                                        model.device)
                self.tables[g] = GroupTables(self.buckets, max_seqs, pages, g, model.device, cfgs, **split)
        a = model.layers[0].attn
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        n, h, dt, dev = self.buckets[-1], model.cfg.hidden_size, model.dtype, model.device
        with torch.inference_mode():
            self.ids = torch.zeros(n, dtype=torch.long, device=dev)  # [B] token ids
            self.x = torch.zeros(n, h, dtype=dt, device=dev)  # [B, H] residual stream between pieces
            self.qkv = torch.zeros(n, q + 2 * kv, dtype=dt, device=dev)  # [B, N] a piece's QKV, an island's input
            self.o = torch.zeros(n, q, dtype=dt, device=dev)  # [B, Q] an island's output, the next piece's input
            self.hidden = torch.zeros(n, h, dtype=dt, device=dev)  # [B, H] the last piece's output
            half = a.head_dim // 2
            self.cos = torch.zeros(n, half, dtype=torch.float32, device=dev)  # [B, D/2] graphed layers' RoPE
            self.sin = torch.zeros(n, half, dtype=torch.float32, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.mempool = None

    def bucket(self, t: int) -> int | None:
        """The smallest bucket >= t tokens; None: the step runs the eager forward."""
        return next((b for b in self.buckets if b >= t), None) if t > 0 else None

    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.ids, self.x, self.qkv, self.o, self.hidden, self.cos, self.sin))

    # ---- the split forward ------------------------------------------------------------------------
    def absorbed(self, k: int) -> range:
        """The layers piece k holds whole (their attention inside the graph): between islands k-1 and k."""
        lo = self.islands[k - 1] + 1 if k > 0 else 0
        return range(lo, self.islands[k] if k < len(self.islands) else len(self.model.layers))

    def piece(self, k: int, b: int) -> None:
        """Piece k (0..len(islands)) on the first b rows of the static buffers: what a graph of bucket b
        replays. Without graphed attention piece k is layer k-1's O projection and MLP, then layer k's QKV."""
        m, be = self.model, self.model.backends
        if k == 0:
            x, pending = m.embed[self.ids[:b]], None  # [b, H]
        else:
            prev = m.layers[self.islands[k - 1]]
            x, pending = prev.mlp_residual(self.x[:b], prev.attn.project(self.o[:b], be), be)
        for i in self.absorbed(k):
            block = m.layers[i]
            x, h = block.attn_input(x, pending, be)
            o = self._graphed_attend(i, block.attn.qkv(h, be), b)  # [b, Q]
            x, pending = block.mlp_residual(x, block.attn.project(o, be), be)
        if k == len(self.islands):
            self.hidden[:b].copy_(m.final_norm(x, pending))
            return
        block = m.layers[self.islands[k]]
        x, h = block.attn_input(x, pending, be)
        self.x[:b].copy_(x)
        self.qkv[:b].copy_(block.attn.qkv(h, be))

    def _graphed_attend(self, i: int, qkv: torch.Tensor, b: int) -> torch.Tensor:
        """Layer i's RoPE + attention + store on the bucket's rows, from the step's tables of its page group
        (qkv [b, N] -> [b, Q]): what a graph holds for it (kernels/triton_graph_attention.py)."""
        from kernels.triton_graph_attention import graphed_attention
        from kernels.triton_store_kv import rope_qk, store_kv

        attn = self.model.layers[i].attn
        tables = self.tables[attn.group]
        q, k, v = attn.split_qkv(qkv)  # [b, Hq, D], [b, Hkv, D] x 2
        q, k = rope_qk(q, k, self.cos[:b], self.sin[:b])
        k_cache, v_cache = self.pool.layer_kv(i)
        scale = self.pool.layer_scales(i)
        store_kv(k, v, k_cache, v_cache, tables.slots_pre[:b], scale)  # steps whose pages hold all: store first
        o = graphed_attention(q, k, v, (k_cache, v_cache), tables, b, attn.sinks, attn.sm_scale, attn.window, scale)
        store_kv(k, v, k_cache, v_cache, tables.slots_post[:b], scale)  # chunks past the ring: after the read
        return o.reshape(b, attn.num_heads * attn.head_dim)

    def plan(self, step: StepMeta) -> None:
        """Before the step's pieces: the attention backend's plan for the groups islands read, and the
        graphed groups' tables (host work and small copies; idempotent per step)."""
        if step is self._planned:
            return
        self._planned = step
        be = self.model.backends
        if not self.tables:
            be.attention.plan(step)
            return
        b = self.bucket(step.positions.shape[0])
        for t in self.tables.values():
            t.fill(step, b)
        if self.islands:  # the backend plans only the groups islands read (FlashInfer: no chunk gather for them)
            groups = tuple(None if g in self.tables else m for g, m in enumerate(step.groups))
            be.attention.plan(dataclasses.replace(step, groups=groups))

    def island(self, i: int, t: int, cos: torch.Tensor, sin: torch.Tensor, kv: KVPool | None) -> None:
        """Layer i's attention on the t real tokens (eager: it depends on the step's page tables)."""
        attn = self.model.layers[i].attn
        o = attn.attend(self.qkv[:t], cos, sin, self.model.backends, kv.layer_kv(i) if kv is not None else None,
                        kv.layer_scales(i) if kv is not None else None)  # [t, Q]
        self.o[:t].copy_(o)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, step: StepMeta, kv: KVPool | None,
            on_layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids [T] (T <= the largest bucket) -> final-normed hidden states [T, H], a view of a
        static buffer the next step overwrites (consumers queued before it on the stream read it).
        `on_layer_done(i)` runs right after layer i stored its K/V (island i)."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        assert b is not None, f"{t} tokens: no bucket (the caller runs the eager forward)"
        assert self.pool is None or kv is self.pool, "the graphed pieces were captured on the engine's pool"
        graphs = self.graphs.get(b)
        self.ids[:t].copy_(input_ids)
        cos, sin = self.model.rotary.cos_sin(step.positions)  # [T, D/2] each, real tokens only
        if self.tables:
            self.cos[:t].copy_(cos)
            self.sin[:t].copy_(sin)
        self.plan(step)  # a no-op when the runner planned this step
        for k in range(self.num_pieces):
            with label(f"piece{k}"):
                if graphs is not None:
                    graphs[k].replay()
                else:
                    self.piece(k, b)
            for i in self.absorbed(k):
                if on_layer_done is not None:
                    on_layer_done(i)
            if k < len(self.islands):
                i = self.islands[k]
                with label(f"attention{i}"):
                    self.island(i, t, cos, sin, kv)
                if on_layer_done is not None:
                    on_layer_done(i)
        return self.hidden[:t]

    # ---- capture ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first, all pieces into one pool (CUDA only: on a CPU the pieces run
        directly). Each bucket first runs its pieces twice outside capture (Triton compilation,
        DeepGEMM launchers, cuBLAS handles, all-reduce buffers), as the decode graphs do."""
        if self.model.device.type != "cuda":
            log.info("piecewise pieces: %d x buckets %s, run directly on their static buffers (no CUDA graphs on %s)",
                     self.num_pieces, list(self.buckets), self.model.device.type)
            return
        dev = self.model.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        for b in sorted(self.buckets, reverse=True):
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    for i in range(self.num_pieces):
                        self.piece(i, b)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graphs = []
            for i in range(self.num_pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.mempool):
                    self.piece(i, b)
                self.mempool = self.mempool or g.pool()
                graphs.append(g)
            self.graphs[b] = graphs
        torch.cuda.synchronize(dev)
        log.info("captured piecewise CUDA graphs: %d pieces x buckets %s; static buffers %.1f MiB, graph pool "
                 "%.1f MiB, reserved by warm-up and capture %.1f MiB", self.num_pieces, list(self.buckets),
                 self.static_bytes() / 2**20, self.pool_bytes() / 2**20,
                 (torch.cuda.memory_reserved(dev) - before) / 2**20)

    def pool_bytes(self) -> int:
        """Device memory held by the graphs' pool (the largest bucket's peak piece, about)."""
        if self.mempool is None:
            return 0
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == tuple(self.mempool))
