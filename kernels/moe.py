"""The gpt-oss MoE layer in Triton (MoEImpl): routing, grouped expert GEMMs, combine.

Steps (MODEL_SPEC §1.2, §6), one launch each, no host sync (CUDA-graph capturable):
  1. route     logits [T, E] -> top-k + softmax over the k (moe_align.route_topk_softmax)
  2. group     (token, slot) pairs -> rows grouped by local expert, padded to BLOCK_M; pairs routed
               to experts another EP rank owns are dropped (moe_align.align_by_expert)
  3. quantise  x -> e4m3 1x128 per token, once per token (FP8 weights only)
  4. gate_up   act = SwiGLU(x W1[e]^T + b1[e]) per row tile of one expert. The accumulator starts
               at b1; gate/up rows of W1 are interleaved, so (gate_i, up_i) are adjacent output
               columns and the clamped SwiGLU runs in the epilogue on column pairs. With FP8 and
               256-wide tiles each tile holds exactly one 1x128 group of act, so its re-quantisation
               is fused too; other tile widths write act in x.dtype and run step 3 on it.
  5. down      y = (act W2[e]^T + b2[e]) rounded to x.dtype, times the routing weight (reference
               rounding points), written per pair
  6. combine   out[t] = sum over local slots of y[t, j], in fp32

Two regimes share the code and differ by tile table (kernels/tuning, by routed rows per expert):
prefill (thousands of tokens, compute-bound: 128-row tiles, grouped tile order for L2 reuse) and
decode (1..128 tokens, bandwidth-bound: 16-row tiles; only tiles of experts that received tokens
run, so only the selected experts' weights are read). Native (bf16/fp32) weights use the same
kernels without scales. Shapes: T tokens, H hidden, E experts (El local), I intermediate per rank,
P = T * top_k pairs, R = row capacity of the grouping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.fp8_gemm import grouped_tile
from kernels.fp8_quant import FP8_DTYPE, quantize_act_1x128, quantize_tile
from kernels.interface import ExpertWeights
from kernels.moe_align import ExpertGrouping, align_by_expert, route_topk_softmax
from kernels.moe_gemm import expert_gemm, expert_gemm_tma
from kernels.reference import BLOCK, FP8_MAX
from kernels.tuning import MoEConfig, TileConfig, moe_config


@triton.jit
def round_as(v, CODE: tl.constexpr):
    """fp32 v rounded to the dtype _ROUND_CODE names (0 bf16, 1 fp16, 2 fp32: unchanged), back in fp32:
    the reference's rounding points inside fp32 epilogues."""
    if CODE == 0:
        v = v.to(tl.bfloat16).to(tl.float32)
    elif CODE == 1:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def split_tile(PHASE: tl.constexpr, SPLIT_K: tl.constexpr):
    """(split index, tile index) of this program: phase 1 runs SPLIT_K programs per tile."""
    pid = tl.program_id(0)
    if PHASE == 1:
        ks = pid % SPLIT_K
        tile = pid // SPLIT_K
    else:
        ks = 0
        tile = pid
    return ks, tile


@triton.jit
def split_range(ks, K, PHASE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """K range [k_lo, k_hi) of split ks in phase 1 (whole BLOCK_K blocks, the last split takes the
    tail); the whole K otherwise."""
    if PHASE == 1:
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = ks * per
        k_hi = tl.maximum(tl.minimum(K, k_lo + per), k_lo)
    else:
        k_lo = 0
        k_hi = K
    return k_lo, k_hi


@triton.jit
def split_partials(ws_ptr, rows, valid, rn, owned, stride_ws_s, stride_ws_r, acc,
                   PHASE: tl.constexpr, SPLIT_K: tl.constexpr, ks):
    """PHASE 1 stores this split's fp32 partial [BM, BN] (the columns this tile owns: a last tile's
    wrapped columns belong to the first); PHASE 2 returns acc + every split's partial, summed in
    split order (deterministic, whatever order the CTAs ran in)."""
    ptrs = ws_ptr + rows[:, None].to(tl.int64) * stride_ws_r + rn[None, :]
    if PHASE == 1:
        tl.store(ptrs + ks * stride_ws_s, acc, mask=valid[:, None] & owned[None, :])
    else:
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ptrs + s * stride_ws_s, mask=valid[:, None], other=0.0)
    return acc


@triton.jit
def expert_tile(acc, a_ptr, as_ptr, a_rows, stride_a, stride_as_row, stride_as_k, w_ptr, w_desc, ws_ptr, e, n0,
                rn, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, K, part_ptr, rows, valid, owned,
                stride_ps, stride_pr, ks, FP8: tl.constexpr, TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, DOT_F32: tl.constexpr, PHASE: tl.constexpr,
                SPLIT_K: tl.constexpr):
    """The tile's A . W[e]^T part for both expert GEMMs: the whole K (phase 0), one split's K range
    stored as a partial (phase 1), or acc plus the stored partials (phase 2). A row r of the tile
    reads row a_rows[r] of A (gathered tokens for gate_up, grouped rows for down)."""
    if PHASE == 2:
        acc = split_partials(part_ptr, rows, valid, rn, owned, stride_ps, stride_pr, acc, PHASE, SPLIT_K, ks)
    else:
        k_lo, k_hi = split_range(ks, K, PHASE, SPLIT_K, BLOCK_K)
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]  # [BM, BK]
        b_ptrs = w_ptr + e * stride_we + rn[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        as_ptrs = as_ptr + a_rows * stride_as_row
        bs_ptrs = ws_ptr + e * stride_wse + (rn // SCALE_K) * stride_wsn
        if TMA:  # FP8 only (the host builds no descriptor otherwise)
            acc = expert_gemm_tma(acc, a_ptrs, w_desc, e.to(tl.int32), n0, as_ptrs, bs_ptrs, k_lo, k_hi,
                                  stride_as_k, stride_wsk, BLOCK_N, BLOCK_K, SCALE_K)
        else:
            acc = expert_gemm(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, k_lo, k_hi, stride_as_k, stride_wsk,
                              FP8, BLOCK_K, SCALE_K, DOT_F32)
        if PHASE == 1:
            split_partials(part_ptr, rows, valid, rn, owned, stride_ps, stride_pr, acc, PHASE, SPLIT_K, ks)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, b_ptr, act_ptr, acts_ptr,
                    sorted_ptr, block_expert_ptr, num_rows_ptr, part_ptr,
                    N, K, I, num_pairs, max_blocks, alpha, limit,
                    stride_xt, stride_xst, stride_xsk, stride_we, stride_wn, stride_wse, stride_wsn,
                    stride_wsk, stride_be, stride_am, stride_ask, stride_ps, stride_pr,
                    TOP_K: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr, QUANT_OUT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, SCALE_K: tl.constexpr, FP8_MAX_C: tl.constexpr,
                    DOT_F32: tl.constexpr, PHASE: tl.constexpr, SPLIT_K: tl.constexpr,
                    HW_CVT: tl.constexpr):
    """PHASE 0: the whole tile. Split-K: PHASE 1 (grid x SPLIT_K) writes fp32 partials of one K
    range, PHASE 2 sums them and runs the epilogue."""
    ks, tile = split_tile(PHASE, SPLIT_K)
    pid_m, pid_n = grouped_tile(tile, max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return  # beyond the rows in use: experts without tokens cost nothing
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] grouped rows
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    tok = tl.where(valid, pair // TOP_K, 0)  # padding rows read token 0, never stored
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # N = 2I is even, so wrapped columns keep (gate, up) pairs together
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PHASE != 1:
        acc += tl.load(b_ptr + e * stride_be + rn).to(tl.float32)[None, :]  # start at b1
    acc = expert_tile(acc, x_ptr, xs_ptr, tok, stride_xt, stride_xst, stride_xsk, w_ptr, w_desc, ws_ptr, e,
                      pid_n * BLOCK_N, rn, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, K, part_ptr,
                      rows, valid, offs_n < N, stride_ps, stride_pr, ks, FP8, TMA, BLOCK_N, BLOCK_K, SCALE_K,
                      DOT_F32, PHASE, SPLIT_K)
    if PHASE == 1:
        return
    # Clamped SwiGLU on interleaved columns: 2i = gate_i, 2i+1 = up_i.
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))  # [BM, BN/2] each
    gate = tl.minimum(gate, limit)  # from above only
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    offs_i = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    imask = offs_i < I
    out_ptrs = act_ptr + rows[:, None] * stride_am + offs_i[None, :]
    smask = valid[:, None] & imask[None, :]
    if QUANT_OUT:  # BLOCK_N // 2 == 128: this tile is exactly 1x128 group pid_n of each row
        q, scale = quantize_tile(tl.where(imask[None, :], act, 0.0), imask[None, :], FP8_MAX_C, HW_CVT)
        tl.store(out_ptrs, q.to(act_ptr.dtype.element_ty), mask=smask)
        tl.store(acts_ptr + pid_n * stride_ask + rows, scale, mask=valid)
    else:
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _down_kernel(a_ptr, as_ptr, w_ptr, w_desc, ws_ptr, b_ptr, rw_ptr, y_ptr,
                 sorted_ptr, block_expert_ptr, num_rows_ptr, part_ptr, N, K, num_pairs, max_blocks,
                 stride_am, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn,
                 stride_wsk, stride_be, stride_ym, stride_ps, stride_pr,
                 FP8: tl.constexpr, TMA: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 SCALE_K: tl.constexpr, OUT_ROUND: tl.constexpr, DOT_F32: tl.constexpr,
                 PHASE: tl.constexpr, SPLIT_K: tl.constexpr):
    ks, tile = split_tile(PHASE, SPLIT_K)
    pid_m, pid_n = grouped_tile(tile, max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS and PHASE != 1:  # b2: one EP rank (or TP rank 0) adds it, inside the routing weight
        acc += tl.load(b_ptr + e * stride_be + rn).to(tl.float32)[None, :]
    # act rows are already grouped: tile row r reads act row rows[r]
    acc = expert_tile(acc, a_ptr, as_ptr, rows, stride_am, stride_asm, stride_ask, w_ptr, w_desc, ws_ptr, e,
                      pid_n * BLOCK_N, rn, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, K, part_ptr,
                      rows, valid, offs_n < N, stride_ps, stride_pr, ks, FP8, TMA, BLOCK_N, BLOCK_K, SCALE_K,
                      DOT_F32, PHASE, SPLIT_K)
    if PHASE == 1:
        return
    wgt = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)  # [BM] routing weight
    # Reference rounding points: the linear's output in x.dtype, then times the weight.
    y = round_as(acc, OUT_ROUND) * wgt[:, None]
    tl.store(y_ptr + pair[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n < N)[None, :])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, H, expert_start, num_local, stride_ym, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j) - expert_start
        if (e >= 0) & (e < num_local):  # slots routed to another rank's experts add nothing here
            acc += tl.load(y_ptr + (t * TOP_K + j) * stride_ym + offs, mask=hmask).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


_ROUND_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def weight_desc(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor | None:
    """FP8 [E, N, K] expert weights as a TMA descriptor with [1, block_n, block_k] boxes, or None
    where TMA cannot address them (unaligned base or strides)."""
    ok = (w.dtype == FP8_DTYPE and w.dim() == 3 and w.stride(-1) == 1 and w.data_ptr() % 16 == 0
          and all(st % 16 == 0 for st in w.stride()[:-1]))
    return TensorDescriptor.from_tensor(w, [1, block_n, block_k]) if ok else None


def _launch_cfg(cfg: TileConfig, device: torch.device) -> dict[str, int]:
    # Triton on CPU tensors means TRITON_INTERPRET, whose bf16 tl.dot is wrong: upcast there only.
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, DOT_F32=device.type == "cpu")


def gate_up(x: torch.Tensor, xs: torch.Tensor | None, w: ExpertWeights, g: ExpertGrouping, top_k: int,
            cfg: TileConfig, act_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] (e4m3 with xs [T, KB], or native) -> act [R, I] in grouped row order (+ act scales
    [R, I/128] with strides (1, R) when re-quantisation is fused)."""
    fp8 = w.w1_scale is not None
    n, k = w.w1.shape[1], w.w1.shape[2]
    i = n // 2
    rows = g.sorted_pairs.shape[0]
    quant_out = fp8 and cfg.block_n == 2 * BLOCK
    act = torch.empty(rows, i, dtype=FP8_DTYPE if quant_out else act_dtype, device=x.device)
    acts_buf = torch.empty(-(-i // BLOCK), rows, dtype=torch.float32, device=x.device) if quant_out else None
    xs_ = xs if xs is not None else x  # unused pointer when not FP8
    ws = w.w1_scale if fp8 else w.w1
    acts_arg = acts_buf if acts_buf is not None else act
    tiles = g.max_blocks * triton.cdiv(n, cfg.block_n)
    desc = weight_desc(w.w1, cfg.block_n, cfg.block_k) if (fp8 and cfg.tma) else None
    for phase, grid, part in _phases(cfg, tiles, rows, n, act):
        _gate_up_kernel[(grid,)](
            x, xs_, w.w1, desc, ws, w.b1, act, acts_arg, g.sorted_pairs, g.block_expert, g.num_rows, part,
            n, k, i, g.num_pairs, g.max_blocks, float(w.alpha), float(w.limit),
            x.stride(0), xs_.stride(0), xs_.stride(1) if xs is not None else 0,
            w.w1.stride(0), w.w1.stride(1), ws.stride(0), ws.stride(1) if fp8 else 0,
            ws.stride(2) if fp8 else 0, w.b1.stride(0), act.stride(0), acts_arg.stride(0),
            part.stride(0), part.stride(1),
            TOP_K=top_k, FP8=fp8, TMA=desc is not None, QUANT_OUT=quant_out, SCALE_K=BLOCK, FP8_MAX_C=FP8_MAX,
            PHASE=phase, SPLIT_K=cfg.split_k, HW_CVT=x.is_cuda, **_launch_cfg(cfg, x.device))
    return act, (acts_buf.t() if acts_buf is not None else None)


def _phases(cfg: TileConfig, tiles: int, rows: int, n: int, unused: torch.Tensor
            ) -> list[tuple[int, int, torch.Tensor]]:
    """(phase, grid, partials) launches of one GEMM: phase 0 alone (its partials argument is never
    read: `unused`, any 2-d tensor, stands in), or split-K partials (phase 1, tiles x split_k CTAs
    into fp32 [split_k, R, N]) then their fix-up (phase 2)."""
    if cfg.split_k <= 1:
        return [(0, tiles, unused)]
    part = torch.empty(cfg.split_k, rows, n, dtype=torch.float32, device=unused.device)  # only used rows are touched
    return [(1, tiles * cfg.split_k, part), (2, tiles, part)]


def down(act: torch.Tensor, acts: torch.Tensor | None, w: ExpertWeights, g: ExpertGrouping,
         weights: torch.Tensor, cfg: TileConfig, out_dtype: torch.dtype) -> torch.Tensor:
    """act [R, I] grouped rows -> y [P, H] per pair: (act W2^T + b2) * routing weight."""
    fp8 = w.w2_scale is not None
    n, k = w.w2.shape[1], w.w2.shape[2]
    y_dtype = torch.promote_types(out_dtype, weights.dtype)
    y = torch.empty(g.num_pairs, n, dtype=y_dtype, device=act.device)
    ws = w.w2_scale if fp8 else w.w2
    as_ = acts if acts is not None else act
    b2 = w.b2 if w.b2 is not None else w.w2
    tiles = g.max_blocks * triton.cdiv(n, cfg.block_n)
    desc = weight_desc(w.w2, cfg.block_n, cfg.block_k) if (fp8 and cfg.tma) else None
    for phase, grid, part in _phases(cfg, tiles, act.shape[0], n, y):
        _down_kernel[(grid,)](
            act, as_, w.w2, desc, ws, b2, weights, y, g.sorted_pairs, g.block_expert, g.num_rows, part,
            n, k, g.num_pairs, g.max_blocks,
            act.stride(0), as_.stride(0), as_.stride(1) if fp8 else 0,
            w.w2.stride(0), w.w2.stride(1), ws.stride(0), ws.stride(1) if fp8 else 0,
            ws.stride(2) if fp8 else 0, b2.stride(0), y.stride(0), part.stride(0), part.stride(1),
            FP8=fp8, TMA=desc is not None, HAS_BIAS=w.b2 is not None, SCALE_K=BLOCK, OUT_ROUND=_ROUND_CODE[out_dtype],
            PHASE=phase, SPLIT_K=cfg.split_k, **_launch_cfg(cfg, act.device))
    return y


def combine(y: torch.Tensor, ids: torch.Tensor, w: ExpertWeights, out_dtype: torch.dtype) -> torch.Tensor:
    t, top_k = ids.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    block_h = 1024
    _combine_kernel[(t, triton.cdiv(h, block_h))](y, ids, out, h, w.expert_start, w.num_local,
                                                   y.stride(0), out.stride(0), TOP_K=top_k,
                                                   BLOCK_H=block_h, num_warps=4)
    return out


class TritonMoE:
    name = "triton"

    def __init__(self, config: MoEConfig | None = None, small_max_pairs: int = 8) -> None:
        from kernels.moe_small import SmallBatchMoE  # noqa: PLC0415 - it imports this module

        self.config = config  # None: the tuned table by routed rows per expert
        # FP8 with at most this many (token, slot) pairs and no fixed config: the three-launch
        # few-token path (kernels/moe_small.py); 0 disables it.
        self.small_max_pairs = small_max_pairs
        self.small = SmallBatchMoE()

    def config_for(self, num_tokens: int, top_k: int, w: ExpertWeights, fp8: bool) -> MoEConfig:
        if self.config is not None:
            return self.config
        rows_per_expert = -(-num_tokens * top_k // w.num_experts)
        return moe_config(rows_per_expert, w.w1.shape[1], w.w1.shape[2], fp8)

    def _small(self, num_tokens: int, top_k: int, fp8: bool) -> bool:
        return fp8 and self.config is None and num_tokens * top_k <= self.small_max_pairs

    def takes_fp8_input(self, num_tokens: int, top_k: int, w: ExpertWeights) -> bool:
        """FP8 experts, on either path (the few-token path quantises x inside its gate_up CTAs otherwise)."""
        return w.w1_scale is not None and num_tokens > 0

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, w: ExpertWeights,
                 x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        t, h = x.shape
        assert router_logits.shape == (t, w.num_experts), "router logits must be [T, E]"
        if t == 0:
            return torch.zeros_like(x)
        fp8 = w.w1_scale is not None
        assert (w.w2_scale is not None) == fp8, "w1 and w2 must both be FP8 or both native"
        if self._small(t, top_k, fp8):
            return self.small(x, router_logits, top_k, w, x_fp8)
        cfg = self.config_for(t, top_k, w, fp8)
        weights, ids = route_topk_softmax(router_logits, top_k)  # [T, k] each
        g = align_by_expert(ids, w.expert_start, w.num_local, cfg.block_m)
        if fp8:  # once per token, not per (token, expert) pair; or by the norm before (x_fp8)
            xq, xs = x_fp8 if x_fp8 is not None else quantize_act_1x128(x)
        else:
            xq, xs = (x if x.dtype == w.w1.dtype else x.to(w.w1.dtype)), None
        act_dtype = x.dtype if fp8 else w.w2.dtype  # native: act feeds W2's dot directly
        act, acts = gate_up(xq, xs, w, g, top_k, cfg.gemm1, act_dtype)  # [R, I]
        if fp8 and acts is None:  # tile width without fused re-quantisation
            act, acts = quantize_act_1x128(act)
        y = down(act, acts, w, g, weights, cfg.gemm2, x.dtype)  # [P, H]
        return combine(y, ids, w, x.dtype)
