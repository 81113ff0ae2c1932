"""FlashInferAttention: the AttentionImpl on FlashInfer 0.6.6's AttentionSink JIT variant (GPU only).

Why the JIT variant: the ordinary wrappers accept `sinks=` and silently ignore it on Hopper
(MODEL_SPEC.md §4). The AttentionSink variant adds the fp32 sink as a raw logit to the online
softmax (fa2: only in KV tile 0, so split-KV merges stay right; fa3 does not split KV).

Lifecycle:
  * construction imports flashinfer (ConfigError when it or CUDA is missing). `cache_dir` sets
    FLASHINFER_WORKSPACE_BASE before that import: FlashInfer keeps its JIT builds under
    <base>/.cache/flashinfer/<version>/<arch>/cached_ops, so a restart with the same folder loads
    the built .so files instead of compiling again (13 s fa2 / 65 s fa3 per variant on the H200).
  * `prepare(dims, windows)` (or the first forward) builds the variants (shapes that change later,
    e.g. after the start-up self-test, just get new wrappers; the compiled modules are shared): one per (backend, window
    kind); sliding layers use window_left = W - 1 = 127, full layers -1. Prefill uses fa3 on sm90a
    (fa2 if fa3 fails to build), decode fa2 (fa3 does not pack GQA heads into a q tile, so q_len 1
    would fill one 192-row tile per head).
  * `plan(step)` plans each page group once; every layer of the group reuses that plan. Pure-decode
    steps of up to TRITON_DECODE_MAX_SEQS sequences over 16-bit pages run the Triton decode kernel.
  * `forward`: no cache, or a prefill step with no cached prefix (`fresh_prefill`) -> ragged causal over the
    step's own tokens, then store; pages_hold_all -> store, then paged; otherwise -> gather [prefix from
    pages ; new K/V] densely, ragged, then store. Prefill steps' sliding ragged reads run on fa2
    (`sliding_prefill`; set_prefill_reads says why). With
    rope= (Fusion.ROPE_STORE) q and k arrive unrotated: where the store comes first (paged, FP8
    prefill) one launch rotates q and k and stores (`rope_qk_store_kv`), elsewhere they are rotated
    first, as the model would have.
  * FP8 (e4m3) pages (`FP8_KV` below): pure-decode steps run on our Triton decode kernel by default
    (`fp8_decode="triton"`: kernels/triton_decode.py, planned and graphed by a TritonAttention this
    backend drives); FlashInfer's own path (`fp8_decode="flashinfer"`) reads them with fa2 (its fa2
    template widens e4m3 K/V tiles to the query dtype in registers, head_dim 64 included; its
    fa3/sm90 mainloop has no bf16 x e4m3 GMMA and its FP8 path wants q in e4m3 too) through our
    variant of the sink template with per-KV-head K/V scales, and measured 0.568 of copy bandwidth
    at 128 x 8k (benchmarks/results/2026-12-02/fp8-kv-2): not bandwidth-bound either.
    Prefill steps store, then read their keys back dequantised (`gather_kv`) into the bf16 ragged
    kernel (fa3), so prefill keeps fa3's speed; steps that also hold one-token rows read the pages in
    place on the fa2 variant (`fp8_mixed_paged`; flashinfer_plans says why). If the FP8 variant cannot be built (flashinfer
    mode), FP8 layers run on TritonAttention and the log says why.
  * decode CUDA graphs: `enable_cuda_graphs(batch_sizes, max_pages_per_seq)`; a pure-decode step
    of one of those batch sizes then runs on wrappers with static index buffers (page indices,
    indptrs, last-page lengths, and the slot_mapping the store reads). plan() runs outside the
    graph (host work + copies into those buffers), forward() inside it; q/k/v/sinks and the caches
    are the caller's static tensors. Planning the same StepMeta again is a no-op (the model's
    forward plans too, also while being captured).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from common.errors import ConfigError
from kernels.flashinfer_fp8kv import FP8_KV
from kernels.flashinfer_host import AttentionDims, import_flashinfer
from kernels.flashinfer_plans import FlashInferPlans, GroupPlan
from kernels.flashinfer_variants import build_variant
from kernels.interface import StepMeta
from kernels.triton_store_kv import gather_kv, rope_qk, rope_qk_store_kv, store_kv

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partials), shared by all wrappers
# How prefill steps read keys by default (set_prefill_reads). prefill-reads-ab-1 (H100, 20b, 8k prompt, per full
# layer): fa3 ragged 1.25 ms vs paged 1.37; the sliding layers on fa2 158 us vs fa3's 287 (fa3 spends ~5x a
# window's share of work there). The 8k prefill 87.3 -> 85.1 ms; at 2k within noise.
FRESH_PREFILL = "ragged"
SLIDING_PREFILL: str | None = "fa2"
# Pure-decode steps over 16-bit pages of at most this many sequences read on the Triton decode kernel
# (ONE_SEQ_BF16_DECODE while this is 1, else BF16_DECODE) instead of fa2. 20b at 8k: batch 1 replays 2.805 -> 2.737
# ms (b1-ab-1, H100) and 2.415 -> 2.336 (tdecode-ab-1, H200); batch 4 is 1 % slower (b1-ab-1), 64 and 128 1 %
# (tdecode-ab-1). decode_kernel="triton" takes every batch.
TRITON_DECODE_MAX_SEQS = 1


class FlashInferAttention(FlashInferPlans):
    name = "flashinfer"

    def __init__(self, *, prefill_backend: str = "auto", decode_backend: str = "fa2",
                 cache_dir: str | None = None, fp8_decode: str = "triton", decode_kernel: str = "flashinfer") -> None:
        self._fi = import_flashinfer(cache_dir)
        for b in (prefill_backend, decode_backend):
            if b not in ("auto", "fa2", "fa3"):
                raise ConfigError(f"unknown FlashInfer backend {b!r} (auto, fa2, fa3)")
        if fp8_decode not in ("triton", "flashinfer"):
            raise ConfigError(f"unknown e4m3 decode kernel {fp8_decode!r} (triton, flashinfer)")
        if decode_kernel not in ("triton", "flashinfer"):
            raise ConfigError(f"unknown 16-bit decode kernel {decode_kernel!r} (triton, flashinfer)")
        self._fp8_decode_kind = fp8_decode
        self._all_decode_triton = decode_kernel == "triton"  # 16-bit pages' pure-decode steps too
        self.triton_decode_max_seqs = TRITON_DECODE_MAX_SEQS  # ... of small batches only otherwise (0: none)
        if self._all_decode_triton:
            self.name = "flashinfer-triton-decode"
        # TritonAttention for pure-decode steps over e4m3 pages (fp8_decode="triton"), and over 16-bit
        # pages with decode_kernel="triton"
        self._triton_decode = None
        self._want = {"prefill": prefill_backend, "decode": decode_backend}
        # Reads of a step that mixes single-token rows with chunks (paged full layers, ragged sliding
        # chunks): on the decode role's kernel (fa2) or the prefill role's (fa3). fa3 gives each query
        # head of a one-token row its own q tile (no GQA packing), so every decode row reads its whole
        # KV once per query head: at 60 rows x 3.5k beside a 280-token chunk the full layers took
        # 1.63 ms each, 57 % of the step's GPU time, the ragged sliding ones 179 us for ~144 keys per
        # row (mixed-step-5, 2026-12-03); fa2 packs the 8 heads of a group into one tile.
        self.mixed_role = "decode"
        self.fresh_prefill, self.sliding_prefill = FRESH_PREFILL, SLIDING_PREFILL  # set_prefill_reads
        self._backend: dict[str, str] = {}  # resolved per role once the device is known
        self._dims: AttentionDims | None = None
        self._windows: dict[int, int] = {}  # page group -> window_left, learned from forward
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple, object] = {}
        self._graph_sizes: set[int] = set()
        self._graph_max_pages = 0
        self._graph_slots: dict[tuple[int, int], torch.Tensor] = {}  # (batch, window_left) -> [B] int64
        self._step: StepMeta | None = None
        self._plans: dict[int, GroupPlan] = {}
        self._fp8_checked: set[tuple] = set()  # (dtype, head_dim) whose FP8-KV variants were built
        self._fp8_fallback = None  # TritonAttention when FlashInfer cannot read e4m3 pages here
        # FlashInfer's e4m3 paged variants (fa2) built: steps mixing one-token rows with chunks read e4m3 pages in
        # place (flashinfer_plans says why) even where pure-decode steps run the Triton decode kernel
        self.fp8_mixed_paged = True
        self._unit: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def cache_dir(self) -> str:
        from flashinfer.jit import env
        return str(env.FLASHINFER_JIT_DIR)

    # ---- set-up ------------------------------------------------------------------------------------
    def prepare(self, dims: AttentionDims, windows: dict[int, int | None]) -> None:
        """Fix the shapes and build every variant now (start-up), not inside the first step.
        windows: page group -> sliding window or None."""
        self._set_dims(dims)
        for g, w in windows.items():
            self._windows[g] = -1 if w is None else w - 1
        if self._fp8_fallback is not None:
            return
        for role in ("prefill", "decode"):
            for wl in set(self._windows.values()):
                # FP8: prefill reads pages densely (ragged); decode may run on the Triton decode kernel
                # (a decode role whose pure-decode steps all run the Triton decode kernel needs none)
                if (role == "decode" and not self._every_decode_triton(self._dims.fp8_kv)) or (
                        role == "prefill" and not self._dims.fp8_kv):
                    self._wrapper(role, "paged", wl)
                if role == "prefill":
                    self._wrapper(role, "ragged", wl)

    def set_prefill_reads(self, fresh: str = FRESH_PREFILL, sliding: str | None = SLIDING_PREFILL) -> None:
        """How prefill steps read keys. fresh: full layers of a step with no cached prefix, where every
        key is in the step's own k/v: "paged" stores, then reads the pages back (fa3's paged mainloop
        loads page rows one by one), "ragged" reads the dense k/v (fa3's TMA mainloop) and stores after;
        the same values either way. sliding: the backend of sliding-window ragged reads in prefill
        steps ("fa2", "fa3"; None = the prefill role's). Re-plans the next step."""
        if fresh not in ("paged", "ragged") or sliding not in (None, "fa2", "fa3"):
            raise ConfigError(f"unknown prefill reads {fresh!r}/{sliding!r} (paged|ragged, fa2|fa3)")
        self.fresh_prefill, self.sliding_prefill = fresh, sliding
        self._step, self._plans = None, {}

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], max_pages_per_seq: int) -> None:
        self._graph_sizes = set(batch_sizes)
        self._graph_max_pages = max_pages_per_seq
        for t in (self._fp8_fallback, self._triton_decode):
            if t is not None:
                t.enable_cuda_graphs(batch_sizes, max_pages_per_seq)

    def _check_fp8_kv(self, dims: AttentionDims, fallback: bool = True) -> bool:
        """Build the FP8-KV paged variants (fa2, both window kinds) once per (dtype, head_dim): whether they
        built. When they do not, the log says why, and with `fallback` every layer from now on runs on
        TritonAttention (which reads e4m3 pages); without it prefill and mixed steps read back dequantised."""
        key = (dims.dtype, dims.head_dim)
        if key in self._fp8_checked or self._fp8_fallback is not None:
            return key in self._fp8_checked
        try:
            for sliding in (False, True):
                build_variant("fa2", dims.dtype, dims.head_dim, sliding, FP8_KV)
        except Exception as e:  # a JIT build error, or FlashInfer's template text changed (ConfigError)
            log.warning("FlashInfer cannot read e4m3 KV pages here (%s: %s); %s", type(e).__name__, str(e)[-300:],
                        "FP8-KV attention runs on Triton" if fallback else "mixed steps read them back dequantised")
            if fallback:
                self._fp8_fallback = self._triton()
            return False
        self._fp8_checked.add(key)
        return True

    def _fp8_paged(self, dims: AttentionDims) -> bool:
        """Whether FlashInfer's e4m3 paged variants were built for these shapes (_check_fp8_kv)."""
        return (dims.dtype, dims.head_dim) in self._fp8_checked

    def _every_decode_triton(self, fp8_pages: bool) -> bool:
        """Whether every pure-decode step over these pages runs the Triton decode kernel."""
        return self._triton_decode is not None and (fp8_pages or self._all_decode_triton)

    def _triton_decodes(self, fp8_pages: bool, step: StepMeta) -> bool:
        """Whether this step runs the Triton decode kernel: a pure-decode step over e4m3 pages, or over 16-bit
        pages with decode_kernel="triton" or at most triton_decode_max_seqs sequences."""
        return step.is_decode and self._triton_decode is not None and (
            self._every_decode_triton(fp8_pages) or step.num_seqs <= self.triton_decode_max_seqs)

    def _triton(self, decode_all: bool = False):
        """A TritonAttention planned and graphed like this backend (it takes over FP8 layers, or every
        pure-decode step with decode_all: 16-bit pages on the decode kernel, in BF16_DECODE's config, or
        ONE_SEQ_BF16_DECODE's where it only reads one-sequence steps)."""
        from kernels.triton_attention_backend import DecodeKernel, TritonAttention
        from kernels.triton_decode import BF16_DECODE, ONE_SEQ_BF16_DECODE
        one_seq = not self._all_decode_triton and self.triton_decode_max_seqs == 1
        cfg = ONE_SEQ_BF16_DECODE if one_seq else BF16_DECODE
        t = TritonAttention(decode=DecodeKernel.ALL, decode_config=cfg) if decode_all else TritonAttention()
        if self._graph_sizes:
            t.enable_cuda_graphs(sorted(self._graph_sizes), self._graph_max_pages)
        if self._step is not None:
            t.plan(self._step)
        return t

    def _unit_scales(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        t = self._unit.get((n, device))
        if t is None:
            t = self._unit[(n, device)] = torch.ones(n, dtype=torch.float32, device=device)
        return t, t

    def _set_dims(self, dims: AttentionDims) -> None:
        dev = torch.device(dims.device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must compare equal
            dims = dataclasses.replace(dims, device=torch.device("cuda", torch.cuda.current_device()))
        if dims == self._dims:
            return
        if self._dims is not None:  # e.g. the start-up self-test ran on other shapes than the model
            log.info("attention shapes changed from %s to %s: new FlashInfer wrappers", self._dims, dims)
            if dims.device != self._dims.device:
                self._workspace = None
            self._wrappers.clear()
            self._graph_slots.clear()
            self._plans = {}
            self._triton_decode = None  # rebuilt below for the new pages (e4m3 or 16-bit config)
        self._dims = dims
        if (dims.fp8_kv and self._fp8_decode_kind == "triton") or not dims.fp8_kv and (
                self._all_decode_triton or self.triton_decode_max_seqs > 0):
            self._triton_decode = self._triton_decode or self._triton(decode_all=not dims.fp8_kv)
        if dims.fp8_kv and (self._triton_decode is None or self.fp8_mixed_paged):
            self._check_fp8_kv(dims, fallback=self._triton_decode is None)
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dims.device)
            from flashinfer.utils import is_sm90a_supported
            fa3_ok = is_sm90a_supported(dims.device)
            for role, want in self._want.items():
                self._backend[role] = ("fa3" if fa3_ok else "fa2") if want == "auto" else want

    # ---- per step ----------------------------------------------------------------------------------
    def plan(self, step: StepMeta) -> None:
        if step is self._step:
            return  # already planned: GptOss.forward re-plans inside a CUDA-graph capture, where host work is illegal
        self._step = step
        self._plans = {}
        if self._fp8_fallback is not None:
            self._fp8_fallback.plan(step)
            return
        if self._dims is None:
            return  # shapes unknown until the first forward: planned lazily there
        if self._triton_decodes(self._dims.fp8_kv, step):
            self._triton_decode.plan(step)  # every paged read of this step is the decode kernel's
            return
        for gi, g in enumerate(step.groups):
            if g is not None and gi in self._windows:
                self._plans[gi] = self._plan_group(step, g, self._windows[gi])

    def forward(self, group: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None, sinks: torch.Tensor, sm_scale: float,
                window: int | None, kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before forward()"
        window_left = -1 if window is None else window - 1
        page = kv[0].shape[2] if kv is not None else (self._dims.page_size if self._dims else 16)
        kv_dtype = kv[0].dtype if kv is not None else (self._dims.kv_dtype if self._dims else None)
        self._set_dims(AttentionDims(q.shape[1], k.shape[1], q.shape[2], page, q.dtype, q.device, kv_dtype))
        if self._fp8_fallback is not None:
            return self._fp8_fallback.forward(group, q, k, v, kv, sinks, sm_scale, window, kv_scale, rope=rope)
        if self._triton_decodes(kv_dtype == FP8_KV, step):
            self._triton_decode.plan(step)  # a no-op when plan() saw this step (always under graph capture)
            return self._triton_decode.forward(group, q, k, v, kv, sinks, sm_scale, window, kv_scale, rope=rope)
        if self._windows.get(group) != window_left:  # learned from the first layer of the group
            self._windows[group] = window_left
            self._plans.pop(group, None)
        g = step.groups[group]
        sinks = sinks.float().contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even for an unrotated view of qkv
        if rope is not None and (kv is None or g is None):
            q, k = rope_qk(q, k, *rope)
            rope = None
        if kv is None or g is None:
            key = -1 - group  # dense plans live next to the group plans, keyed apart
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = self._plan_dense(step, window_left)
            return plan.wrapper.run(q, k.contiguous(), v.contiguous(), sinks, sm_scale, out=out)
        plan = self._plans.get(group)
        if plan is None:
            plan = self._plans[group] = self._plan_group(step, g, window_left)
        k_cache, v_cache = kv
        fp8 = k_cache.dtype == FP8_KV
        if fp8 and kv_scale is None:
            kv_scale = self._unit_scales(k.shape[1], k.device)
        stores_first = plan.kind == "paged" or plan.read_slots is not None
        if rope is not None:
            if stores_first:  # the paged read (or the FP8 prefill's read-back) never sees the dense k
                q, _ = rope_qk_store_kv(q, k, v, k_cache, v_cache, plan.slots, *rope, kv_scale)
            else:
                q, k = rope_qk(q, k, *rope)
        if plan.kind == "paged":
            if rope is None:
                store_kv(k, v, k_cache, v_cache, plan.slots, kv_scale)
            if fp8:
                return plan.wrapper.run(q, (k_cache, v_cache), sinks, kv_scale[0], kv_scale[1], sm_scale, out=out)
            return plan.wrapper.run(q, (k_cache, v_cache), sinks, sm_scale, out=out)
        if plan.read_slots is not None:  # FP8 prefill: store, then every key back from the pages
            if rope is None:
                store_kv(k, v, k_cache, v_cache, plan.slots, kv_scale)
            keys, vals = gather_kv(k_cache, v_cache, plan.read_slots, kv_scale, q.dtype)
            return plan.wrapper.run(q, keys, vals, sinks, sm_scale, out=out)
        if plan.gather is not None:  # some sequence has a cached prefix: [prefix ; new] per sequence, one launch
            # e4m3 prefixes dequantised; the chunk's own K/V stay unquantised, as in the reference
            keys, vals = gather_kv(k_cache, v_cache, plan.gather, kv_scale if fp8 else None, k.dtype, new=(k, v))
        else:
            keys, vals = k.contiguous(), v.contiguous()
        out = plan.wrapper.run(q, keys, vals, sinks, sm_scale, out=out)
        store_kv(k, v, k_cache, v_cache, g.slot_mapping, kv_scale)
        return out
