"""PrefillEngine: batch-1 prefill whose KV goes straight into a decode worker's reserved pages.

    run(request):
        hit = prefix cache lookup; pages = the hit's + allocate(rest)   # this worker's own pages
        forward chunks from the hit; before the last chunk: sender.start(transfer, pages)
        last chunk: on_layer_done(i) -> sender writes layer i while layer i+1 computes
        first token sampled from the last position
        wait until the transfer is terminal (deadline) -> release pages (their blocks stay cached)
        -> PrefillResult

The prefill worker keeps its own prefix cache (model/prefix_cache.py): computing a suffix needs the
prefix KV in its own pages, and a turn of a conversation usually extends the previous turn's
prompt. Decode names its own cached prefix in the TransferRequest (first_token): only the pages
after it are shipped, whatever this worker had to compute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.errors import ProtocolError
from engine.build import EngineParts
from engine.sampling import to_params
from engine.scheduler import ScheduledSeq, note_ring_write
from engine.sequence import Sequence
from kv_transfer.interface import KVSender, TransferStatus
from kv_transfer.messages import FailureReason, TransferRequest
from kv_transfer.messages import decode as decode_kv
from model.kv_cache import OutOfPages, SeqPages
from wire.protocol import PrefillRequest, PrefillResult, TopLogprob

log = logging.getLogger("tandem.prefill")


def _failed(rid: str, error: str, t0: float) -> PrefillResult:
    return PrefillResult(rid, False, -1, None, [], error, time.monotonic() - t0, 0, 0.0)


class PrefillEngine:
    def __init__(self, parts: EngineParts, sender: KVSender) -> None:
        self.parts, self.tx = parts, sender
        self.kv, self.runner = parts.kv, parts.runner
        self.chunk = parts.scheduler.cfg.max_num_batched_tokens
        self.copy_sources = SeqPages()  # the running request's prefix-hit copy sources (held to its end)

    def run(self, m: PrefillRequest, aborted: Callable[[], bool] = lambda: False) -> PrefillResult:
        t0 = time.monotonic()
        try:
            req = decode_kv(m.kv_target, TransferRequest)
        except ProtocolError as e:
            return _failed(m.request_id, f"bad kv target: {e.message}", t0)
        if req.num_tokens != len(m.prompt_ids):
            return _failed(m.request_id, "kv target reserves a different prompt length", t0)
        seq = Sequence(m.request_id, list(m.prompt_ids), to_params(m.sampling))
        sched = self.parts.scheduler
        try:
            sched.check_fits(len(m.prompt_ids), 1)
            sched.admit_pages(seq, sched.lookup(seq), len(m.prompt_ids))
        except OutOfPages:
            return _failed(m.request_id, "prompt does not fit this prefill worker's KV cache", t0)
        except Exception as e:  # noqa: BLE001 - InvalidRequest from check_fits
            return _failed(m.request_id, str(e), t0)
        self.copy_sources = SeqPages()
        ok = False
        try:
            res = self._run(m, req, seq, aborted, t0)
            ok = True
            return res
        finally:  # computed blocks are cached (valid whatever the transfer did); a failed forward caches nothing
            self.kv.release(seq.pages, sched.registration(seq) if ok else None)
            self.kv.release(self.copy_sources)
            self.parts.sampler.forget(m.request_id)

    def _run(self, m: PrefillRequest, req: TransferRequest, seq: Sequence, aborted: Callable[[], bool],
             t0: float) -> PrefillResult:
        n = len(m.prompt_ids)
        pos, tokens, lps = seq.num_cached, [None], [None]
        spec = self.kv.spec
        started = False
        try:
            while pos < n:
                q = min(self.chunk, n - pos)
                last = pos + q == n
                if last:
                    self.tx.start(req, seq.pages)
                    started = True
                tokens, lps = self.runner.run([ScheduledSeq(seq, pos, q, last)],
                                              on_layer_done=self.tx.layer_done if last else None)
                note_ring_write(seq, pos, pos + q, spec.page_size, spec.sliding_window)
                if seq.pages.copy_src:  # the hit's sliding blocks were copied: the sources go at the end
                    self.copy_sources = self.kv.release_copy_sources(seq.pages)
                seq.num_cached = pos = pos + q
        except ProtocolError as e:
            return _failed(m.request_id, f"kv transfer refused: {e.message}", t0)
        except Exception:
            if started:
                self.tx.abort(m.request_id, FailureReason.ABORTED, "prefill forward failed")
                self._wait_terminal(m.request_id, time.monotonic() + 10)
                self.tx.finish(m.request_id)
            raise
        compute_s = time.monotonic() - t0
        deadline = time.monotonic() + max(0.0, req.deadline_unix - time.time())
        status = self._wait_terminal(m.request_id, deadline, aborted)
        outcome = self.tx.finish(m.request_id)
        if status != TransferStatus.DONE:
            why = outcome.reason.label if outcome.reason else "unknown"
            return _failed(m.request_id, f"kv transfer {why}: {outcome.detail}", t0)
        lp = lps[0]
        return PrefillResult(m.request_id, True, int(tokens[0]), lp.logprob if lp else None,
                             [TopLogprob(t, v) for t, v in lp.top] if lp else [], "", compute_s,
                             outcome.num_bytes, outcome.seconds, 0.0, time.monotonic() - t0 - compute_s,
                             seq.num_cached_prefix)

    def _wait_terminal(self, rid: str, deadline: float, aborted: Callable[[], bool] = lambda: False) -> TransferStatus:
        while True:
            st = self.tx.poll(rid)
            if st.terminal:
                return st
            if aborted():
                self.tx.abort(rid, FailureReason.ABORTED, "aborted by the router")
            elif time.monotonic() > deadline:
                self.tx.abort(rid, FailureReason.DEADLINE, "transfer did not finish before its deadline")
            time.sleep(0.0005)
