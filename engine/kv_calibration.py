"""FP8 KV scales at start-up: from the checkpoint, from calibration prompts, or the default.

`kv_scales_for(model, n_prompts)` picks the table (model/kv_scales.py says why each source and the
default). Calibration (`--kv-scale-calibration N`) runs N prompts through the model without a cache
(attention over each prompt's own tokens, nothing quantised) and records, per layer and KV head,
max |K| after RoPE and max |V| exactly as the attention backend receives them; under TP each rank
measures its own heads and the table is gathered, so every rank (and every worker that calibrates
on the same model and prompts) builds the same global table, which the KV handshake then compares.

Prompts: the passages of kv_calibration_prompts.json (prose, code, math, a Harmony chat, JSON/SQL,
several languages; ~1.3k o200k_harmony tokens), all of them in one prompt, rotated by one passage
per prompt. Ids beyond a small test vocabulary are folded into it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kernels.interface import AttentionImpl
from model.context import SeqStep, build_step_meta
from model.gpt_oss import GptOss
from model.kv_scales import KVScales

log = logging.getLogger("tandem.engine")

PROMPTS_FILE = Path(__file__).with_name("kv_calibration_prompts.json")


def calibration_prompts(n: int, vocab_size: int) -> list[list[int]]:
    passages = [p["ids"] for p in json.loads(PROMPTS_FILE.read_text())["passages"]]
    out = []
    for i in range(n):
        k = i % len(passages)
        ids = [t for p in passages[k:] + passages[:k] for t in p]
        out.append([t % vocab_size for t in ids])
    return out


class _AmaxRecorder:
    """Wraps the model's attention backend for calibration forwards: layer i of a forward is the
    i-th call (GptOss runs its layers in order); records max |k|, |v| per KV head, then delegates."""

    def __init__(self, inner: AttentionImpl, num_layers: int, num_kv_heads: int) -> None:
        self.inner, self.name = inner, inner.name
        self.k_amax = torch.zeros(num_layers, num_kv_heads)
        self.v_amax = torch.zeros(num_layers, num_kv_heads)
        self.calls = 0

    def plan(self, step) -> None:
        self.calls = 0
        self.inner.plan(step)

    def forward(self, group, q, k, v, kv, sinks, sm_scale, window, kv_scale=None):
        i = self.calls
        self.calls += 1
        self.k_amax[i] = torch.maximum(self.k_amax[i], k.detach().float().abs().amax(dim=(0, 2)).cpu())
        self.v_amax[i] = torch.maximum(self.v_amax[i], v.detach().float().abs().amax(dim=(0, 2)).cpu())
        return self.inner.forward(group, q, k, v, kv, sinks, sm_scale, window, kv_scale=kv_scale)


@torch.inference_mode()
def measure_kv_amax(model: GptOss, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """max |K| (after RoPE) and max |V| per layer and GLOBAL KV head over the prompts: ([L, Hkv], [L, Hkv])."""
    cfg, par = model.cfg, model.par
    rec = _AmaxRecorder(model.backends.attention, cfg.num_hidden_layers, cfg.num_key_value_heads // par.tp_size)
    model.backends.attention = rec
    try:
        for ids in prompts:
            step = build_step_meta([SeqStep(None, 0, len(ids))], None, model.device)
            model.forward(torch.tensor(ids, dtype=torch.long, device=model.device), step, None)
            assert rec.calls == cfg.num_hidden_layers, "calibration expects one attention call per layer"
    finally:
        model.backends.attention = rec.inner
    k, v = rec.k_amax, rec.v_amax
    if par.tp_size > 1:  # each rank measured its own heads: gather them (rank-major = head order)
        dev = model.device
        k = par.all_gather_last(k.to(dev)).cpu()
        v = par.all_gather_last(v.to(dev)).cpu()
    return k, v


def kv_scales_for(model: GptOss, calibration_prompts_n: int) -> KVScales:
    """The FP8 KV scale table of this worker: checkpoint > calibration > default (logged)."""
    cfg = model.cfg
    ckpt = getattr(model, "checkpoint_kv_scales", None)
    if ckpt is not None:
        if calibration_prompts_n:
            log.info("KV scales: the checkpoint's; --kv-scale-calibration %d ignored", calibration_prompts_n)
        scales = ckpt
    elif calibration_prompts_n > 0:
        k, v = measure_kv_amax(model, calibration_prompts(calibration_prompts_n, cfg.vocab_size))
        scales = KVScales.from_amax(k, v, f"calibrated:{calibration_prompts_n}")
        log.info("KV amax over %d calibration prompts: K %.3g (max), V %.3g (max)", calibration_prompts_n,
                 float(k.max()), float(v.max()))
    else:
        scales = KVScales.default(cfg.num_hidden_layers, cfg.num_key_value_heads)
    log.info("FP8 KV scales: %s", scales.describe())
    return scales
