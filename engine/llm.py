"""LLMEngine (the single-process engine: add_request / step) and LLM (the offline generate API).

    engine.step():  done = core.step()     # engine.core: schedule, launch, collect the step before
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from common.errors import ConfigError, InvalidRequest
from engine.build import EngineConfig, build_engine_parts
from engine.core import EngineCore
from engine.sampling import SamplingParams
from engine.sequence import FinishReason, Sequence, TokenLogprob, attach_grammar

log = logging.getLogger("tandem.engine")


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]  # prompt tokens 1.. when SamplingParams.prompt_logprobs asked


class LLMEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        if cfg.cuda_graphs and not cfg.device.startswith("cuda"):
            raise ConfigError(f"cuda_graphs needs a CUDA device, not {cfg.device!r}")
        parts = build_engine_parts(cfg)
        self.cfg, self.model, self.kv, self.scheduler, self.runner = (
            cfg, parts.model, parts.kv, parts.scheduler, parts.runner)
        self.sampler = parts.sampler
        if cfg.cuda_graphs:
            from engine.decode_graphs import CudaGraphDecoder

            sc = cfg.scheduler
            self.runner.graphs = CudaGraphDecoder(self.model, self.runner.pool, self.kv, sc.max_num_seqs,
                                                  sc.max_model_len)
            self.runner.graphs.capture()
        self.core = EngineCore(self.scheduler, self.runner, overlap=cfg.async_decode)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        rid = request_id or f"req-{next(self._ids)}"
        seq = Sequence(rid, list(prompt_ids), params, arrival=time.monotonic())
        bad = [t for t in prompt_ids if not 0 <= t < self.model.cfg.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary", param="prompt")
        attach_grammar(seq)
        self.scheduler.add(seq)
        self.seqs[rid] = seq
        return rid

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.core.abort(seq)
            self.sampler.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_work

    def step(self) -> list[StepOutput]:
        done = self.core.step()
        outs = []
        for seq in done:
            lp = [seq.logprobs[-1]] if seq.params.logprobs is not None and seq.logprobs else []
            outs.append(StepOutput(seq.request_id, [seq.output_ids[-1]], lp, seq.finished, seq.finish_reason))
            if seq.finished:
                self.seqs.pop(seq.request_id, None)
                self.sampler.forget(seq.request_id)
        return outs


class LLM:
    """Offline generation: `LLM(EngineConfig(...)).generate([[ids...], ...], SamplingParams(...))`."""

    def __init__(self, cfg: EngineConfig | None = None) -> None:
        self.engine = LLMEngine(cfg or EngineConfig())

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        seqs = {rid: self.engine.seqs[rid] for rid in rids}
        while self.engine.has_unfinished():
            self.engine.step()
        return [Completion(rid, s.prompt_ids, s.output_ids, s.finish_reason or FinishReason.ABORT, s.logprobs,
                           s.prompt_logprobs) for rid, s in seqs.items()]

    @property
    def kv(self):
        return self.engine.kv
