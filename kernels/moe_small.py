"""The FP8 MoE layer for a few tokens (decode at batch 1): two launches instead of nine.

At batch 1 the layer must read 4 experts' weights (100 MB for gpt-oss) and little else, yet the
grouped path (kernels/moe.py) spends a third of its time between launches: route, group, quantise
x, gate_up + split-K fix-up, quantise act, down + fix-up, combine. Here:

  1. gate_up    one CTA per (pair, N tile, K split). Each CTA routes its token itself (the grouped
                path's top-k + softmax on 32-128 logits; one CTA per token stores ids and weights
                for the down kernel) and quantises the token's x over its own K range to e4m3 1x128
                (quantize_act_1x128's bits; CTAs of one token and split write identical bytes):
                a separate routing launch cost ~4.3 us on the critical path (run X). Then the
                grouped path's K loop without grouping: pair p = t * top_k + j reads expert
                ids[p]'s rows directly. Split-K partials go to fp32 scratch; the CTA that arrives
                last at the tile's counter sums them in split order (deterministic), adds b1, runs
                the clamped SwiGLU and re-quantises its 128 act columns (one 1x128 group: 256-wide
                tiles) to e4m3 act [P, I] + scales [P, I/128].
  2. down       one CTA per (token, N tile, slot, K split). The last CTA of a (token, N tile) sums
                each slot's partials in split order, adds b2, rounds to x.dtype, multiplies by the
                routing weight, rounds again (the grouped path's rounding points) and sums the
                slots in fp32: down, bias, weighting and combine in one launch.

Counters (int32, one per output tile) are reset by the CTA that consumed them, so a CUDA graph can
replay the layer; they live in a per-(device, stream) buffer zeroed once. Arrival is CUTLASS's
split-K semaphore: all threads store, barrier, one release atomic; the last CTA reads the partials
past L1 (.cg). Slots whose expert another EP rank owns are skipped: their CTAs only arrive. With
programmatic dependent launch each kernel's CTAs are resident before the one ahead finishes and
wait for it (griddepcontrol.wait) before reading its output.
Shapes: T tokens, H hidden, E experts (El local), I intermediate per rank, P = T * top_k pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8_quant import FP8_DTYPE, quantize_tile
from kernels.interface import ExpertWeights
from kernels.moe import _ROUND_CODE, round_as, split_range, weight_desc
from kernels.moe_align import store_routes, topk_softmax_rows
from kernels.moe_small_tiles import arrive, quantise_row_range, tile_gemm
from kernels.reference import BLOCK, FP8_MAX


@triton.jit
def route_row(logits_ptr, rw_ptr, ids_ptr, t, j, writer, E, stride_lt, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_TK: tl.constexpr):
    """Token t's expert in slot j (top-k + softmax of its logits, every program its own); the writer program (writer
    != 0) also stores the token's ids and weights for the launch after."""
    rows = t + tl.arange(0, 1)  # [1]
    ids, w = topk_softmax_rows(logits_ptr, rows, rows >= 0, E, stride_lt, TOP_K, BLOCK_E, BLOCK_TK)
    store_routes(ids_ptr, rw_ptr, rows, ids, w, (rows * 0 + writer) > 0, TOP_K, BLOCK_TK)
    return tl.sum(tl.sum(tl.where((tl.arange(0, BLOCK_TK) == j)[None, :], ids, 0), axis=1), axis=0)


@triton.jit
def route_and_quantise_row(logits_ptr, rw_ptr, ids_ptr, x_ptr, xq_ptr, xs_ptr, t, j, writer, k_lo, k_hi, E,
                           stride_lt, stride_xt, stride_xqt, stride_xsk, TOP_K: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr, BLOCK_GX: tl.constexpr,
                           FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr, QUANT_X: tl.constexpr = True):
    """route_row and, with QUANT_X, x[t, k_lo:k_hi] in e4m3 1x128 groups to xq / xs, which this CTA's K loop then
    reads (without: the norm before wrote them; b1-probes-2: quantising here cost gate_up ~2 us of its 35 at one
    token)."""
    e = route_row(logits_ptr, rw_ptr, ids_ptr, t, j, writer, E, stride_lt, TOP_K, BLOCK_E, BLOCK_TK)
    if QUANT_X:
        quantise_row_range(x_ptr, xq_ptr, xs_ptr, t, k_lo, k_hi, stride_xt, stride_xqt, stride_xsk, BLOCK_GX,
                           FP8_MAX_C, HW_CVT)
    return e


@triton.jit
def _gate_up_small_kernel(logits_ptr, rw_ptr, ids_ptr, x_ptr, xq_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, b_ptr, part_ptr,
                          sem_ptr, act_ptr, acts_ptr, N, K, I, E, expert_start, num_local, alpha, limit,
                          stride_lt, stride_xt, stride_xqt, stride_xsk, stride_we, stride_wn, stride_wse,
                          stride_wsn, stride_wsk, stride_be, stride_ps, stride_pp, stride_ap, stride_asp,
                          TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TK: tl.constexpr,
                          BLOCK_GX: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                          SCALE_K: tl.constexpr, FP8_MAX_C: tl.constexpr, HW_CVT: tl.constexpr,
                          DOT_F32: tl.constexpr, PDL: tl.constexpr, QUANT_X: tl.constexpr):
    if PDL:  # launched early (programmatic dependent launch): the router's logits come first;
        gdc_wait()  # then the down kernel may launch, its CTAs taking SMs as these retire
        gdc_launch_dependents()
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // SPLIT_K) % num_n
    p = pid // SPLIT_K // num_n
    t = p // TOP_K
    j = p % TOP_K
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    writer = ((j == 0) & (nt == 0) & (ks == 0)).to(tl.int32)
    e = route_and_quantise_row(logits_ptr, rw_ptr, ids_ptr, x_ptr, xq_ptr, xs_ptr, t, j, writer, k_lo, k_hi, E,
                               stride_lt, stride_xt, stride_xqt, stride_xsk, TOP_K, BLOCK_E, BLOCK_TK,
                               BLOCK_GX, FP8_MAX_C, HW_CVT, QUANT_X) - expert_start
    if (e < 0) | (e >= num_local):
        return  # another EP rank's expert: no act row; the down kernel skips this slot too
    e32 = e
    e = e.to(tl.int64)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # wrapped columns read valid rows and are never stored
    nmask = offs_n < N
    part = tile_gemm(xq_ptr + t * stride_xqt, xs_ptr + t, stride_xsk, w_ptr + e * stride_we, w_desc, e32,
                     nt * BLOCK_N, ws_ptr + e * stride_wse, rn, k_lo, k_hi, stride_wn, stride_wsn, stride_wsk,
                     SWAP_AB, TMA, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, DOT_F32)  # [BN]
    last = True
    if SPLIT_K > 1:
        p_ptrs = part_ptr + p * stride_pp + offs_n
        tl.store(p_ptrs + ks * stride_ps, part, mask=nmask)
        last = arrive(sem_ptr + p * num_n + nt, SPLIT_K)
    if last:
        v = tl.load(b_ptr + e * stride_be + rn).to(tl.float32)  # start at b1
        if SPLIT_K == 1:
            v += part
        else:
            for s in tl.static_range(SPLIT_K):
                v += tl.load(p_ptrs + s * stride_ps, mask=nmask, other=0.0, cache_modifier=".cg")
        # Clamped SwiGLU on interleaved columns: 2i = gate_i, 2i+1 = up_i.
        gate, up = tl.split(tl.reshape(v, (BLOCK_N // 2, 2)))
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)  # [BN/2] = exactly 1x128 group nt of act
        offs_i = nt * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        imask = (offs_i < I)[None, :]
        q, scale = quantize_tile(tl.where(imask, tl.reshape(act, (1, BLOCK_N // 2)), 0.0), imask, FP8_MAX_C,
                                 HW_CVT)  # [1, BN/2], [1]
        tl.store(act_ptr + p * stride_ap + offs_i[None, :], q.to(act_ptr.dtype.element_ty), mask=imask)
        tl.store(acts_ptr + p * stride_asp + nt + tl.arange(0, 1), scale)


@triton.jit
def _down_small_kernel(act_ptr, acts_ptr, ids_ptr, rw_ptr, w_ptr, w_desc, ws_ptr, b_ptr, part_ptr, sem_ptr, out_ptr,
                       N, K, expert_start, num_local,
                       stride_ap, stride_asp, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                       stride_be, stride_pj, stride_ps, stride_pt, stride_ot,
                       TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_ROUND: tl.constexpr,
                       Y_ROUND: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SCALE_K: tl.constexpr,
                       DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    ks = pid % SPLIT_K
    j = (pid // SPLIT_K) % TOP_K
    num_n = tl.cdiv(N, BLOCK_N)
    nt = (pid // SPLIT_K // TOP_K) % num_n
    t = pid // SPLIT_K // TOP_K // num_n
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    nmask = offs_n < N
    p_ptrs = part_ptr + t * stride_pt + offs_n  # + slot * stride_pj + split * stride_ps
    k_lo, k_hi = split_range(ks, K, 1, SPLIT_K, BLOCK_K)
    if PDL:
        gdc_wait()  # ids, weights, act and its scales are gate_up's output
    e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
    if (e >= 0) & (e < num_local):
        e64 = e.to(tl.int64)
        p = t * TOP_K + j
        part = tile_gemm(act_ptr + p * stride_ap, acts_ptr + p * stride_asp, 1, w_ptr + e64 * stride_we, w_desc,
                         e, nt * BLOCK_N, ws_ptr + e64 * stride_wse, rn, k_lo, k_hi, stride_wn, stride_wsn,
                         stride_wsk, SWAP_AB, TMA, BLOCK_M, BLOCK_N, BLOCK_K, SCALE_K, DOT_F32)
        tl.store(p_ptrs + j * stride_pj + ks * stride_ps, part, mask=nmask)
    if arrive(sem_ptr + t * num_n + nt, TOP_K * SPLIT_K):
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(TOP_K):  # slots in order, like the grouped path's combine
            ej = tl.load(ids_ptr + t * TOP_K + jj) - expert_start
            ejv = tl.full((BLOCK_N,), 0, tl.int32) + ej  # a vector: the interpreter cannot & a scalar mask
            m = nmask & (ejv >= 0) & (ejv < num_local)
            v = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if HAS_BIAS:  # b2 (one EP rank, or TP rank 0, holds it), inside the routing weight
                v += tl.load(b_ptr + ej.to(tl.int64) * stride_be + rn, mask=m, other=0.0).to(tl.float32)
            for s in tl.static_range(SPLIT_K):
                v += tl.load(p_ptrs + jj * stride_pj + s * stride_ps, mask=m, other=0.0, cache_modifier=".cg")
            # Reference rounding points: the linear's output in x.dtype, times the weight, in y's dtype.
            y = round_as(round_as(v, OUT_ROUND) * tl.load(rw_ptr + t * TOP_K + jj).to(tl.float32), Y_ROUND)
            out += tl.where(m, y, 0.0)  # slots of another rank's experts add nothing
        tl.store(out_ptr + t * stride_ot + offs_n, out.to(out_ptr.dtype.element_ty), mask=nmask)


@dataclass(frozen=True, slots=True)
class SmallConfig:
    """Tiles of the few-token path. split_k 0 = chosen per call so that about `ctas_per_sm` CTAs
    per SM exist (few pairs: split K more; more pairs: less)."""

    # The padded token side: mma.sync's 16 rows (weights converted to f16 in registers), or with
    # swap_ab the wgmma's N = 16 (64 rows unswapped also run wgmma, but slower: run S3).
    block_m: int = 16
    # True: W is the MMA's M side (wgmma on e4m3 in shared memory), block_m = the padded token side
    swap_ab: bool = False
    tma: bool = False  # swapped tiles only: weight tiles by TMA bulk copies (tensor descriptors)
    block_n1: int = 256  # gate_up N tile: 256 interleaved columns = one 1x128 group of act (fixed)
    block_n2: int = 128  # down N tile
    split_k1: int = 0
    split_k2: int = 0
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 3
    # Programmatic dependent launch (GPU only): each kernel's CTAs launch while the one before
    # finishes and wait for it. (An L2 prefetch of down's weights before the wait did not help: run U.)
    pdl: bool = False


def choose_split(tiles: int, k: int, num_sms: int, ctas_per_sm: int, fixed: int) -> int:
    """K splits for `tiles` output tiles: enough CTAs to fill the GPU, each with >= 2 K blocks. A
    fixed split (tuned on whole experts) stands while it gives every SM a CTA; smaller problems
    (TP-sharded experts: fewer N tiles) fall back to the rule."""
    if fixed and tiles * fixed >= num_sms:
        return fixed
    max_split = max(1, triton.cdiv(k, BLOCK) // 2)
    return max(1, min(max_split, round(num_sms * ctas_per_sm / max(tiles, 1))))


class _Counters:
    """Per (device, stream) zeroed int32 counters; kernels leave them zero after each call. A
    buffer outgrown by a larger call stays alive: a captured CUDA graph may still point into it."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            if buf is not None:
                self._outgrown.append(buf)
            buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
            self._bufs[key] = buf
        return buf


# Measured on the H200 (runs V-Z: 20b/120b experts, hidden = intermediate = 2880, two weight
# seeds): swapped wgmma tiles, weights by TMA, PDL; gate_up split in 2 (longer contiguous runs per
# weight row), down in 4. Up to 4 pairs 3 stages (184 gate_up CTAs, two per SM): T = 1 38.5-38.7 us
# vs 40.6-40.9 with per-thread copies (run Z); up to 8 pairs 2 stages, so all 368 gate_up CTAs are
# resident at once (3 stages: a second wave, 8-12 % slower).
DEFAULT_SMALL_CONFIGS: tuple[tuple[int, SmallConfig], ...] = (
    (4, SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=4, num_stages=3, pdl=True)),
    (8, SmallConfig(swap_ab=True, tma=True, split_k1=2, split_k2=4, num_stages=2, pdl=True)),
)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(slots=True)
class GateUpOut:
    """What the gate_up launch leaves for the down launch (and for tests): routing weights [T, k]
    in the logits dtype, expert ids [T, k] int32, x in e4m3 [T, H] with its 1x128 scales [T, KB]
    (strides (1, T)), act in e4m3 [P, I] with its scales [P, I/128]."""

    weights: torch.Tensor
    ids: torch.Tensor
    xq: torch.Tensor
    xs: torch.Tensor
    act: torch.Tensor
    acts: torch.Tensor


class SmallBatchMoE:
    """FP8 MoE for T * top_k <= max_pairs (TritonMoE dispatches here)."""

    def __init__(self, config: SmallConfig | None = None, ep_split_scale: bool = False) -> None:
        self.config = config  # None: DEFAULT_SMALL_CONFIGS by pair count
        # Expert parallelism: a rank owns ~El/E of the pairs, so only that share of the CTAs works
        # (the others route and return). True: split K E/El times finer (capped), so the rank's own
        # pairs still spread over the GPU. Not measured yet: off by default.
        self.ep_split_scale = ep_split_scale
        self._counters = _Counters()

    def _split(self, tiles: int, k: int, dev: torch.device, c: SmallConfig, fixed: int, w: ExpertWeights) -> int:
        s = choose_split(tiles, k, _num_sms(dev), c.ctas_per_sm, fixed)
        if self.ep_split_scale and w.num_local < w.num_experts:
            s = max(s, min(max(1, triton.cdiv(k, BLOCK) // 2), round(s * w.num_experts / w.num_local)))
        return s

    @staticmethod
    def config_for(pairs: int) -> SmallConfig:
        for bound, cfg in DEFAULT_SMALL_CONFIGS:
            if pairs <= bound:
                return cfg
        return DEFAULT_SMALL_CONFIGS[-1][1]

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x_fp8: x already in e4m3 1x128 groups (quantize_act_1x128's bits and layout; the fused norm
        makes it): gate_up's CTAs then only route their token before streaming."""
        assert w.w1_scale is not None and w.w2_scale is not None, "the few-token path is FP8 only"
        c = self.config or self.config_for(x.shape[0] * top_k)
        if x.stride(1) != 1:
            x = x.contiguous()
        if router_logits.stride(1) != 1:
            router_logits = router_logits.contiguous()
        sems = self._counters.get(x.shape[0] * top_k * triton.cdiv(w.w1.shape[1], c.block_n1)
                                  + x.shape[0] * triton.cdiv(w.w2.shape[1], c.block_n2), x.device)
        g = self.gate_up(x, router_logits, top_k, w, c, sems, x_fp8)
        return self.down(g, x.dtype, top_k, w, c, sems)

    @staticmethod
    def _desc(w: torch.Tensor, c: SmallConfig, block_n: int) -> TensorDescriptor | None:
        """TMA descriptor of [E, N, K] weights for tma configs (swapped tiles only), else None."""
        return weight_desc(w, block_n, BLOCK) if (c.swap_ab and c.tma) else None

    def _launch(self, c: SmallConfig, hw: bool, desc: TensorDescriptor | None) -> dict:
        launch = dict(SWAP_AB=c.swap_ab, TMA=desc is not None, BLOCK_M=c.block_m, BLOCK_K=BLOCK, SCALE_K=BLOCK,
                      DOT_F32=not hw, num_warps=c.num_warps, num_stages=c.num_stages, PDL=c.pdl and hw)
        if c.pdl and hw:
            launch["launch_pdl"] = True
        return launch

    def gate_up(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, w: ExpertWeights, c: SmallConfig,
                sems: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> GateUpOut:
        """Launch 1: routing, x quantisation (unless x_fp8 brings it), gate_up + b1 + SwiGLU + act
        re-quantisation."""
        assert c.block_n1 == 2 * BLOCK, "gate_up tiles hold one 1x128 act group: block_n1 = 256"
        t, h = x.shape
        e = logits.shape[1]
        n1, k1 = w.w1.shape[1], w.w1.shape[2]  # 2I, H
        p, dev, hw = t * top_k, x.device, x.device.type == "cuda"
        nt1 = triton.cdiv(n1, c.block_n1)
        s1 = self._split(p * nt1, k1, dev, c, c.split_k1, w)
        if x_fp8 is not None:
            xq, xs = x_fp8
            assert xq.shape == (t, h) and xq.stride(1) == 1 and xs.shape == (t, triton.cdiv(h, BLOCK)) and \
                xs.stride(0) == 1, "x_fp8: quantize_act_1x128's layout (scales with strides (1, T))"
        else:
            xq = torch.empty(t, h, dtype=FP8_DTYPE, device=dev)
            xs = torch.empty(triton.cdiv(h, BLOCK), t, dtype=torch.float32, device=dev).t()
        out = GateUpOut(weights=torch.empty(t, top_k, dtype=logits.dtype, device=dev),
                        ids=torch.empty(t, top_k, dtype=torch.int32, device=dev), xq=xq, xs=xs,
                        act=torch.empty(p, n1 // 2, dtype=FP8_DTYPE, device=dev),
                        acts=torch.empty(p, nt1, dtype=torch.float32, device=dev))  # one per 1x128 group
        part1 = torch.empty(s1, p, n1, dtype=torch.float32, device=dev)
        per_split = triton.cdiv(triton.cdiv(k1, BLOCK), s1)  # 1x128 groups of x each CTA quantises
        desc = self._desc(w.w1, c, c.block_n1)
        _gate_up_small_kernel[(p * nt1 * s1,)](
            logits, out.weights, out.ids, x, out.xq, out.xs, w.w1, desc, w.w1_scale, w.b1, part1, sems, out.act,
            out.acts, n1, k1, n1 // 2, e, w.expert_start, w.num_local, float(w.alpha), float(w.limit),
            logits.stride(0), x.stride(0), out.xq.stride(0), out.xs.stride(1), w.w1.stride(0), w.w1.stride(1),
            w.w1_scale.stride(0), w.w1_scale.stride(1), w.w1_scale.stride(2), w.b1.stride(0), part1.stride(0),
            part1.stride(1), out.act.stride(0), out.acts.stride(0), TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(e), BLOCK_TK=triton.next_power_of_2(top_k),
            BLOCK_GX=triton.next_power_of_2(per_split), BLOCK_N=c.block_n1, SPLIT_K=s1, FP8_MAX_C=FP8_MAX,
            HW_CVT=hw, QUANT_X=x_fp8 is None, **self._launch(c, hw, desc))
        return out

    def down(self, g: GateUpOut, out_dtype: torch.dtype, top_k: int, w: ExpertWeights, c: SmallConfig,
             sems: torch.Tensor) -> torch.Tensor:
        """Launch 2: down + b2 + routing weight + combine over the slots."""
        t = g.ids.shape[0]
        n2, k2 = w.w2.shape[1], w.w2.shape[2]  # H, I
        dev, hw = g.act.device, g.act.device.type == "cuda"
        nt2 = triton.cdiv(n2, c.block_n2)
        s2 = self._split(t * nt2 * top_k, k2, dev, c, c.split_k2, w)
        sem2 = sems[t * top_k * g.acts.shape[1]:]
        part2 = torch.empty(top_k, s2, t, n2, dtype=torch.float32, device=dev)
        out = torch.empty(t, n2, dtype=out_dtype, device=dev)
        b2 = w.b2 if w.b2 is not None else w.w2  # unused pointer without bias
        y_dtype = torch.promote_types(out_dtype, g.weights.dtype)
        desc = self._desc(w.w2, c, c.block_n2)
        _down_small_kernel[(t * nt2 * top_k * s2,)](
            g.act, g.acts, g.ids, g.weights, w.w2, desc, w.w2_scale, b2, part2, sem2, out, n2, k2, w.expert_start,
            w.num_local, g.act.stride(0), g.acts.stride(0), w.w2.stride(0), w.w2.stride(1), w.w2_scale.stride(0),
            w.w2_scale.stride(1), w.w2_scale.stride(2), b2.stride(0), part2.stride(0), part2.stride(1),
            part2.stride(2), out.stride(0), TOP_K=top_k, HAS_BIAS=w.b2 is not None,
            OUT_ROUND=_ROUND_CODE[out_dtype], Y_ROUND=_ROUND_CODE[y_dtype], BLOCK_N=c.block_n2, SPLIT_K=s2,
            **self._launch(c, hw, desc))
        return out
