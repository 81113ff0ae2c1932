"""Where a request's uncached suffix is prefilled: remote (a prefill worker, then a KV transfer) or
locally on the decode worker. Pure; the figures it starts from are measured, not guessed.

Costs are in prefill-token equivalents (time / the measured prefill time per token):
    local  = decode.queued_tokens + 2 * s_d       its own wait, and the decode batch's stall: every
                                                   running sequence waits s_d tokens' prefill once
    remote = T + prefill.queued_tokens + s_p       the prefill worker's queue and compute, plus T: the
                                                   fixed cost of the remote path (admission, the hop to
                                                   the prefill worker, the transfer tail, StartDecode)
s_d / s_p: the tokens each would compute (prompt minus that worker's cached prefix). On an idle fleet
with the same cached prefix on both sides this is "local iff s < T": T is the smallest suffix worth
sending away, `--remote-prefill-min-tokens` (0 = always remote).

Default T, from committed H200 runs of gpt-oss-20b with the workers' defaults:
  * the remote path's fixed cost: TTFT p50 disaggregated 57.03 ms - colocated 49.33 ms = 7.70 ms for
    the same 1792-token prompts, one at a time (benchmarks/results/2026-12-02/served/serve/
    serve_gpu.json, runs "disaggregated single" and "colocated single": the transfer included);
  * prefill time per token at 2k: 25.40 ms / 2048 = 12.4 us (benchmarks/results/2026-12-01/dg17/
    model_dg17-moe_deepgemm-lin_scaled_mm-bf16attn.json; 10.4 us at 8k in the served run's
    model_gpt-oss-20b-tp1-defaults.json: short suffixes are nearer the 2k figure);
  T = 7.70 / 0.0124 = 621 tokens. A local prefill of 621 tokens stalls the decode batch ~7.7 ms, about
  0.7 of one decode step at batch 64 and 8k context (11.09 ms, same served run).
Local prefill is only chosen when the decode worker already holds at least half of the prompt: it is
the continuation path of a conversation. Cold prompts, including those that share only a chat
template's preamble (every Harmony prompt starts with the same ~64-token system block), keep the
deployment's disaggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

REMOTE_OVERHEAD_MS = 57.03 - 49.33  # served run, TTFT p50 disaggregated - colocated, single stream
PREFILL_MS_PER_TOKEN = 25.40 / 2048  # dg17, 2k prefill, workers' defaults
DEFAULT_REMOTE_PREFILL_MIN_TOKENS = round(REMOTE_OVERHEAD_MS / PREFILL_MS_PER_TOKEN)  # 621
# What one running sequence adds to a decode worker's step, in prefill tokens: a decode step at
# batch 64 and 8k context takes 11.09 ms (benchmarks/results/2026-12-02/served/model-20b/
# model_gpt-oss-20b-tp1-defaults.json), 0.173 ms a sequence = 14 tokens.
# A new request's first token shares about one step with the running batch (its suffix is one
# chunk), so placement (router/placement.py) counts each running sequence as this many tokens.
DECODE_STEP_MS_BATCH64 = 11.09
RUNNING_TOKENS = round(DECODE_STEP_MS_BATCH64 / 64 / PREFILL_MS_PER_TOKEN)  # 14


@dataclass(frozen=True, slots=True)
class PrefillCost:
    remote_min_tokens: int = DEFAULT_REMOTE_PREFILL_MIN_TOKENS  # T above; 0: never prefill locally

    def local(self, decode_queued: int, suffix_decode: int) -> float:
        return decode_queued + 2 * suffix_decode

    def remote(self, prefill_queued: int, suffix_prefill: int) -> float:
        return self.remote_min_tokens + prefill_queued + suffix_prefill

    def prefer_local(self, cached_on_decode: int, decode_queued: int, suffix_decode: int,
                     prefill_queued: int, suffix_prefill: int) -> bool:
        if self.remote_min_tokens <= 0 or cached_on_decode <= 0 or cached_on_decode < suffix_decode:
            return False
        return self.local(decode_queued, suffix_decode) <= self.remote(prefill_queued, suffix_prefill)
