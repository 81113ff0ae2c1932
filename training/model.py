"""A trainable gpt-oss on a restricted vocabulary, computing what the served checkpoint computes.

The served model (model.gpt_oss, HF GptOssForCausalLM) runs in fp32 on weights stored in bf16
(embeddings, attention, router, biases, sinks) and MXFP4 (expert matrices). This module is the
same network -- sinks, YaRN RoPE (model.rope), 128-token sliding window on even layers, GQA,
top-k-then-softmax routing, clamped SwiGLU on interleaved gate/up columns, untied head -- written
for batched training with autograd, on `n` used token ids instead of 201,088:

  * embedding and unembedding hold only the used rows; the checkpoint writer gives every other
    token a zero embedding and one shared, trained unembedding row (`unused`), so all unused tokens
    have the same logit. The loss is the full-vocabulary cross entropy of that model: the softmax
    sees the n trained logits plus (V - n) copies of the shared one, one term log(V - n);
  * with `quantize` on, the forward uses the stored weights (bf16 rounding, MXFP4 for experts)
    through a straight-through estimator, so the last training steps see the served model.

Written for a GPU without host synchronisation in the step: the MoE runs every expert on every
token and weights the outputs by the routing (zero for experts a token was not routed to, so
outputs and gradients equal the sparse computation); the loss reads precomputed positions.

Shape legend: B sequences, T tokens, H hidden, Hq / Hkv query / KV heads, G = Hq / Hkv, D head dim,
E experts, I expert width, N = B*T, M loss positions, n used tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference import swiglu
from model.config import GptOssConfig
from model.demo import UNUSED_ROW
from model.quant import dequantize_mxfp4, quantize_mxfp4
from model.rope import Rotary


def _bf16(w: torch.Tensor) -> torch.Tensor:
    return w + (w.to(torch.bfloat16).float() - w).detach()


def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    """[..., out, in] through MXFP4 (32-wide blocks along `in`), straight-through."""
    with torch.no_grad():
        q = dequantize_mxfp4(*quantize_mxfp4(w.detach()), torch.float32)
    return w + (q - w).detach()


def _same(w: torch.Tensor) -> torch.Tensor:
    return w


class Layer(nn.Module):
    def __init__(self, cfg: GptOssConfig, idx: int) -> None:
        super().__init__()
        h, d, e, i = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts, cfg.intermediate_size
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.sliding = cfg.is_sliding(idx)
        self.cfg = cfg

        def lin(out: int, inp: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(out, inp) * std)

        self.attn_norm = nn.Parameter(torch.ones(h))
        self.q_w, self.k_w, self.v_w = lin(hq * d, h, h ** -0.5), lin(hkv * d, h, h ** -0.5), lin(hkv * d, h, h ** -0.5)
        self.q_b, self.k_b, self.v_b = (nn.Parameter(torch.zeros(n)) for n in (hq * d, hkv * d, hkv * d))
        self.o_w = lin(h, hq * d, 0.5 * (hq * d) ** -0.5)
        self.o_b = nn.Parameter(torch.zeros(h))
        self.sinks = nn.Parameter(torch.zeros(hq))
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.router_w = lin(e, h, h ** -0.5)
        self.router_b = nn.Parameter(torch.zeros(e))
        self.w1 = nn.Parameter(torch.randn(e, 2 * i, h) * h ** -0.5)  # [E, 2I, H] checkpoint orientation
        self.b1 = nn.Parameter(torch.zeros(e, 2 * i))
        self.w2 = nn.Parameter(torch.randn(e, h, i) * 0.5 * i ** -0.5)  # [E, H, I]
        self.b2 = nn.Parameter(torch.zeros(e, h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                quantize: bool) -> torch.Tensor:
        """x [B, T, H]; cos/sin [T, D/2]; mask [B, 1, 1, T, T] True where query t may see key s."""
        cfg = self.cfg
        bf = _bf16 if quantize else _same
        b, t, _ = x.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hn = _rms(x, self.attn_norm, cfg.rms_norm_eps)
        q = F.linear(hn, bf(self.q_w), bf(self.q_b)).view(b, t, hkv, hq // hkv, d)
        k = F.linear(hn, bf(self.k_w), bf(self.k_b)).view(b, t, hkv, d)
        v = F.linear(hn, bf(self.v_w), bf(self.v_b)).view(b, t, hkv, d)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # q head h uses KV head h // G: q [B, T, Hkv, G, D] against k [B, T, Hkv, D]
        scores = torch.einsum("bqkgd,bskd->bkgqs", q, k) * d ** -0.5  # [B, Hkv, G, T, T]
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = bf(self.sinks).view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, t, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink has no value
        o = torch.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, t, hq * d)
        x = x + F.linear(o, bf(self.o_w), bf(self.o_b))
        return x + self._moe(_rms(x, self.mlp_norm, cfg.rms_norm_eps), quantize)

    def _moe(self, x: torch.Tensor, quantize: bool) -> torch.Tensor:
        """x [B, T, H]: top-k-then-softmax routing; every expert on every token, weighted by the routing."""
        cfg = self.cfg
        bf, mx = (_bf16, _mxfp4) if quantize else (_same, _same)
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits = F.linear(flat, bf(self.router_w), bf(self.router_b))  # [N, E]
        vals, ids = torch.topk(logits, cfg.num_experts_per_tok, dim=-1)  # [N, K]
        gate = torch.zeros_like(logits).scatter(1, ids, torch.softmax(vals, dim=-1))  # [N, E], zero off-route
        up = torch.einsum("nh,eoh->eno", flat, mx(self.w1)) + bf(self.b1)[:, None, :]  # [E, N, 2I]
        act = swiglu(up, cfg.swiglu_alpha, cfg.swiglu_limit)  # [E, N, I]
        out = torch.einsum("eni,ehi->enh", act, mx(self.w2)) + bf(self.b2)[:, None, :]  # [E, N, H]
        return torch.einsum("enh,ne->nh", out, gate).view_as(x)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX half-split on the last dim; x [B, T, ..., D], cos/sin [T, ..., D/2] (YaRN concentration in)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(0), sin.unsqueeze(0)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class DemoModel(nn.Module):
    def __init__(self, cfg: GptOssConfig, num_used: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed = nn.Parameter(torch.randn(num_used, h))
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Parameter(torch.randn(num_used, h) * h ** -0.5)
        # One unembedding row shared by every token outside the training vocabulary.
        self.unused = nn.Parameter(torch.randn(h) * h ** -0.5)
        self.space = torch.randn(h) * 0.5  # the shared "no leading space" offsets of init_pairs
        self.head_space = torch.randn(h) * 0.5 * h ** -0.5
        self.rotary = Rotary(cfg)
        # The (V - n) unused tokens, each with the shared logit, enter every softmax as one log-count term.
        self.log_unused = math.log(cfg.vocab_size - num_used)

    def to_device(self, device: torch.device | str) -> DemoModel:
        self.to(device)
        self.rotary = Rotary(self.cfg, device)
        return self

    @torch.no_grad()
    def init_pairs(self, pairs: list[tuple[int, int]]) -> None:
        """Initialisation only (training moves every row freely): "w" starts at " w" plus one offset
        shared by all words, in the embedding and in the unembedding, so a copy can drop or add the
        leading space for every word alike."""
        for a, b in pairs:
            self.embed[b] = self.embed[a] + self.space
            self.lm_head[b] = self.lm_head[a] + self.head_space

    def forward(self, ids: torch.Tensor, pad: torch.Tensor, quantize: bool = False) -> torch.Tensor:
        """ids [B, T] (restricted ids), pad [B, T] True on padding -> final-normed hidden states [B, T, H].
        Padding may sit on either side: RoPE scores depend only on relative positions."""
        bf = _bf16 if quantize else _same
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        cos, sin = self.rotary.cos_sin(pos)
        diff = pos[:, None] - pos[None, :]  # [T, T] query - key
        causal = (diff >= 0)[None] & ~pad[:, None, :]  # [B, T, T]
        masks = {False: causal[:, None, None], True: (causal & (diff < self.cfg.sliding_window))[:, None, None]}
        x = bf(self.embed)[ids]
        for layer in self.layers:
            x = layer(x, cos, sin, masks[layer.sliding], quantize)
        return _rms(x, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor, quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> (logits [..., n] of the used tokens, the logit [...] every unused token has)."""
        bf = _bf16 if quantize else _same
        return F.linear(hidden, bf(self.lm_head)), hidden @ bf(self.unused)

    def loss(self, hidden: torch.Tensor, sel: torch.Tensor, targets: torch.Tensor,
             quantize: bool = False) -> torch.Tensor:
        """Full-vocabulary cross entropy at the flat positions `sel` [M] of hidden [B, T, H] against
        targets [M]: the softmax sees the n trained logits and the (V - n) equal unused logits."""
        logits, unused = self.logits(hidden.reshape(-1, hidden.shape[-1])[sel], quantize)  # [M, n], [M]
        lse = torch.logaddexp(torch.logsumexp(logits, -1), unused + self.log_unused)
        return (lse - logits.gather(-1, targets[:, None])[:, 0]).mean()


@torch.no_grad()
def export(model: DemoModel) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors in their stored formats (embedding and head: used rows only), on the CPU."""
    bf = torch.bfloat16

    def c(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.detach().to("cpu", dtype).clone()

    out = {"model.embed_tokens.weight": c(model.embed, bf), "lm_head.weight": c(model.lm_head, bf),
           "model.norm.weight": c(model.norm, torch.float32), UNUSED_ROW: c(model.unused, bf)}
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = c(layer.attn_norm, torch.float32)
        out[p + "post_attention_layernorm.weight"] = c(layer.mlp_norm, torch.float32)
        for name, w, b in (("q_proj", layer.q_w, layer.q_b), ("k_proj", layer.k_w, layer.k_b),
                           ("v_proj", layer.v_w, layer.v_b), ("o_proj", layer.o_w, layer.o_b)):
            out[p + f"self_attn.{name}.weight"], out[p + f"self_attn.{name}.bias"] = c(w, bf), c(b, bf)
        out[p + "self_attn.sinks"] = c(layer.sinks, bf)
        out[p + "mlp.router.weight"], out[p + "mlp.router.bias"] = c(layer.router_w, bf), c(layer.router_b, bf)
        out[p + "mlp.experts.gate_up_proj_bias"] = c(layer.b1, bf)
        out[p + "mlp.experts.down_proj_bias"] = c(layer.b2, bf)
        for name, w in (("gate_up_proj", layer.w1), ("down_proj", layer.w2)):
            out[p + f"mlp.experts.{name}_blocks"], out[p + f"mlp.experts.{name}_scales"] = quantize_mxfp4(c(w, torch.float32))
    return out
