"""FlashInfer's AttentionSink over FP8 (e4m3) KV pages: the pieces `kernels/flashinfer_backend.py` adds.

What FlashInfer 0.6.6 supports (read in its source): the fa2 prefill/paged template instantiates
with DTypeQ bf16 and DTypeKV __nv_fp8_e4m3 -- e4m3 K/V tiles are loaded to shared memory as bytes and
widened to the query dtype in registers (vec_cast), head_dim 64 included (64-byte swizzle) -- and
custom variants keep their logits/output hooks there. The fa3 (sm90) mainloop has no bf16 x e4m3
GMMA, and its FP8 path quantises q too: not what we want. The per-layer scalar k_scale / v_scale
the wrappers accept are ignored for JIT variants, and ours are per KV head anyway, so our variant
applies them itself (`fp8_variant_decl`).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from common.errors import ConfigError
from kernels.interface import GroupMeta

FP8_KV = torch.float8_e4m3fn
FP8_VARIANT = "AttentionSinkKVScale"
# What our FP8 variant adds to FlashInfer's fa2 AttentionSink: params.k_scale / params.v_scale [Hkv]
# fp32. K's scale multiplies the raw logits of its KV head (before the softmax's sm_scale); V's the
# output of each q head of its group (the sink has no value vector, so scaling the output is exact;
# split-KV partials are each scaled, and their merge is linear in them).
_FP8_LOGITS = """
  REGISTER_LOGITS_TRANSFORM(params, logits, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    return logits * params.k_scale[kv_head_idx];
  })
"""
_FP8_OUTPUT_FROM, _FP8_OUTPUT_TO = ("return output * scale * d_rcp;",
                                    "return output * scale * d_rcp * params.v_scale[qo_head_idx / params.group_size];")


def fp8_variant_decl(sink_decl: str) -> str:
    """FlashInfer's fa2 AttentionSink declaration (from the installed package, not a copy) turned into
    FP8_VARIANT. ConfigError when its text is not the one this edit was written against.

    Every whole-word `AttentionSink` is renamed, the constructor's included: a constructor left with
    the old name is, inside `struct AttentionSinkKVScale`, a member function without a return type,
    and nvcc rejects every kernel of the module ("explicit type is missing").
    """
    anchors = ("struct AttentionSink ", "AttentionSink(const Params& params", "REGISTER_LOGITS_MASK(",
               _FP8_OUTPUT_FROM)
    missing = [a for a in anchors if sink_decl.count(a) != 1]
    if missing:
        raise ConfigError(f"FlashInfer's fa2 AttentionSink declaration changed (no unique {missing}): "
                          "cannot derive the FP8-KV variant")
    decl = re.sub(r"\bAttentionSink\b", FP8_VARIANT, sink_decl)
    decl = decl.replace("REGISTER_LOGITS_MASK(", _FP8_LOGITS.strip() + "\n\n  REGISTER_LOGITS_MASK(")
    return decl.replace(_FP8_OUTPUT_FROM, _FP8_OUTPUT_TO)


def read_slots(g: GroupMeta, page_size: int) -> np.ndarray:
    """Slot (page * P + offset) of every key of every sequence's view, sequences back to back
    ([sum kv_lens] int64): what an FP8 prefill reads back from its pages after storing."""
    kv = np.asarray(g.kv_lens_host, dtype=np.int64)
    if g.page_ids_host is not None and len(g.page_ids_host) == int((-(-kv // page_size)).sum()):
        ids = g.page_ids_host.astype(np.int64)
    else:
        table = g.page_table.cpu().numpy().astype(np.int64)
        ids = np.concatenate([table[b, : -(-n // page_size)] for b, n in enumerate(kv)]) if len(kv) else table[:0, 0]
    row0 = np.concatenate(([0], np.cumsum(-(-kv // page_size))[:-1]))
    tok0 = np.concatenate(([0], np.cumsum(kv)[:-1]))
    b = np.repeat(np.arange(len(kv)), kv)
    j = np.arange(int(kv.sum())) - tok0[b]
    return ids[row0[b] + j // page_size] * page_size + j % page_size
