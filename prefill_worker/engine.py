"""PrefillEngine: batch-1 prefill whose KV goes straight into a decode worker's reserved pages.

    run(request, cancelled):
        hit = prefix cache lookup; pages = the hit's + allocate(rest)   # this worker's own pages
        forward chunks from the hit; before the last chunk: sender.start(transfer, pages)
        last chunk: on_layer_done(i) -> sender writes layer i while layer i+1 computes
        first token sampled from the last position
        wait until the transfer is terminal (deadline) -> release pages (their blocks stay cached)
        -> PrefillResult, its compute time split into host before launch / launch / GPU
           (prefill_worker/compute_split.py)

The prefill worker keeps its own prefix cache (model/prefix_cache.py): computing a suffix needs the
prefix KV in its own pages, and a turn of a conversation usually extends the previous turn's
prompt. Decode names its own cached prefix in the TransferRequest (first_token): only the pages
after it are shipped, whatever this worker had to compute.

Cancellation (`cancelled()` returns why, "" while the request should go on: the router's Abort, the
drain deadline): checked before every chunk, while waiting for the transfer, and between layers
when the runner can leave a forward early (one process; a TP group finishes the forward it is in,
its followers being inside the same all-reduces). A started transfer is aborted fail-closed (no
new WRITE, decode told once in-flight ones ended) and this worker's pages are freed at once.
A transfer that failed meanwhile (decode cancelled it: its own Abort, a deadline) stops the
forward the same way: its result could no longer be used. A forward left early caches nothing:
its sliding ring may hold some layers' writes of the interrupted chunk.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from common.errors import InvalidRequest, ProtocolError
from engine import prompt_logprobs
from engine.build import EngineParts
from engine.sampling import check_request, to_params
from engine.scheduler import ScheduledSeq, note_ring_write
from engine.sequence import Sequence, attach_grammar
from kv_transfer.interface import KVSender, TransferStatus
from kv_transfer.messages import FailureReason, TransferRequest
from kv_transfer.messages import decode as decode_kv
from model.kv_cache import SeqPages
from model.page_allocator import OutOfPages
from prefill_worker.compute_split import SplitClock
from wire.protocol import PrefillRequest, PrefillResult, TopLogprob

log = logging.getLogger("tandem.prefill")


def _failed(rid: str, error: str, t0: float) -> PrefillResult:
    return PrefillResult(rid, False, -1, None, [], error, time.monotonic() - t0, 0, 0.0)


class Cancelled(Exception):
    """Raised from the per-layer hook to leave the forward between layers."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def transfer_deadline(req: TransferRequest, deadline_s: float) -> TransferRequest:
    """The transfer's own deadline: `deadline_s` (the router's --transfer-deadline-s) from its start, within
    decode's reservation. The reservation outlives the prompt's queueing and compute (the router asks
    for its prefill timeout plus this); the network part is bounded on its own, so a long prompt's
    compute never eats the transfer's time and a stuck transfer never holds this batch-1 worker long."""
    if not deadline_s > 0:
        return req
    return dataclasses.replace(req, deadline_unix=min(req.deadline_unix, time.time() + deadline_s))


def _never() -> str:
    return ""


class PrefillEngine:
    def __init__(self, parts: EngineParts, sender: KVSender) -> None:
        self.parts, self.tx = parts, sender
        self.kv, self.runner = parts.kv, parts.runner
        self.chunk = parts.scheduler.cfg.max_num_batched_tokens
        self.vocab_size = parts.model.cfg.vocab_size
        self.copy_sources = SeqPages()  # the running request's prefix-hit copy sources (held to its end)
        self.snapshot_pages = SeqPages()  # the running request's branch-point copies (held to its end)
        parts.scheduler.share_prompts = getattr(self.runner, "supports_page_copies", False)
        self.forward_complete = False  # the running request's forward ran to its end (its blocks may be cached)

    def run(self, m: PrefillRequest, cancelled: Callable[[], str] = _never) -> PrefillResult:
        t0 = time.monotonic()
        try:
            req = decode_kv(m.kv_target, TransferRequest)
        except ProtocolError as e:
            return _failed(m.request_id, f"bad kv target: {e.message}", t0)
        if req.request_id != m.request_id:
            return _failed(m.request_id, "kv target was reserved for another request", t0)
        if req.num_tokens != len(m.prompt_ids):
            return _failed(m.request_id, "kv target reserves a different prompt length", t0)
        sched = self.parts.scheduler
        try:
            params = to_params(m.sampling)
            check_request(m.prompt_ids, params, self.vocab_size)
            seq = Sequence(m.request_id, list(m.prompt_ids), params)
            attach_grammar(seq)  # the first token is constrained when the prompt ends inside a target message
            sched.check_fits(len(m.prompt_ids), 1)
            sched.admit_pages(seq, sched.lookup(seq), len(m.prompt_ids))
        except OutOfPages:
            return _failed(m.request_id, "prompt does not fit this prefill worker's KV cache", t0)
        except InvalidRequest as e:
            return _failed(m.request_id, e.message, t0)
        self.copy_sources, self.snapshot_pages = SeqPages(), SeqPages()
        self.forward_complete = False
        try:
            return self._run(m, req, seq, cancelled, t0)
        finally:  # computed blocks are cached (valid whatever the transfer did); a forward that failed or
            # was left early caches nothing (a branch point it reached is: its chunk completed)
            sched.forget_branch(seq)
            self.kv.release(seq.pages, sched.registration(seq) if self.forward_complete else None)
            self.kv.release(self.copy_sources)
            self.kv.release(self.snapshot_pages)
            self.parts.sampler.forget(m.request_id)

    def _run(self, m: PrefillRequest, req: TransferRequest, seq: Sequence, cancelled: Callable[[], str],
             t0: float) -> PrefillResult:
        rid, n = m.request_id, len(m.prompt_ids)
        pos, tokens, lps = seq.num_cached, [None], [None]
        spec = self.kv.spec
        started = False
        clock = SplitClock(t0, self.runner.device)

        def stop_reason() -> str:
            if started and self.tx.poll(rid) == TransferStatus.FAILED:
                return "kv transfer failed"
            if not started and time.time() > req.deadline_unix:  # decode has let the pages go: computing is waste
                return "the decode reservation's deadline passed during prefill"
            return cancelled()

        def check_layer(layer: int, last: bool) -> None:
            if last:
                self.tx.layer_done(layer)
            why = stop_reason()
            if why:
                raise Cancelled(why)

        try:
            while pos < n:
                why = stop_reason()
                if why:
                    raise Cancelled(why)
                q = self.parts.scheduler.chunk_len(seq, pos, min(self.chunk, n - pos))  # ends at a branch point
                last = pos + q == n
                if last:
                    req = transfer_deadline(req, m.deadline_s)
                    self.tx.start(req, seq.pages)
                    started = True
                hook = (lambda i, last=last: check_layer(i, last)) if self.runner.interruptible else \
                    self.tx.layer_done if last else None
                since = clock.launching()
                handle = self.runner.launch([ScheduledSeq(seq, pos, q, last)], None, 0, clock.timed(hook))
                clock.launched(since)
                tokens, lps = self.runner.collect(handle)
                note_ring_write(seq, pos, pos + q, spec.page_size, spec.sliding_window)
                if seq.pages.copy_src:  # the hit's sliding blocks were copied: the sources go at the end
                    self.copy_sources = self.kv.release_copy_sources(seq.pages)
                if self.parts.scheduler.branch_due(seq, pos, pos + q):  # engine/prefix_branch.py
                    src, dst, self.snapshot_pages = self.parts.scheduler.snapshot_branch(seq, pos + q)
                    if src:  # queued before the next chunk writes the ring (one stream)
                        self.runner.copy_sliding_pages(src, dst)
                seq.num_cached = pos = pos + q
            self.forward_complete = True
        except ProtocolError as e:
            return _failed(rid, f"kv transfer refused: {e.message}", t0)
        except Cancelled as c:
            if not started:
                return _failed(rid, f"cancelled before its transfer started: {c.why}", t0)
            self.tx.abort(rid, FailureReason.ABORTED, c.why)  # no-op when the transfer already failed
        except Exception:
            if started:
                self.tx.abort(rid, FailureReason.ABORTED, "prefill forward failed")
                self._wait_terminal(rid, time.monotonic() + 10)
                self.tx.finish(rid)
            raise
        compute_s = time.monotonic() - t0
        split = clock.split()
        deadline = time.monotonic() + max(0.0, req.deadline_unix - time.time())
        status = self._wait_terminal(rid, deadline, cancelled)
        outcome = self.tx.finish(rid)
        if status != TransferStatus.DONE:
            why = outcome.reason.label if outcome.reason else "unknown"
            return _failed(m.request_id, f"kv transfer {why}: {outcome.detail}", t0)
        lp = lps[0]
        return PrefillResult(m.request_id, True, int(tokens[0]), lp.logprob if lp else None,
                             [TopLogprob(t, v) for t, v in lp.top] if lp else [], "", compute_s,
                             outcome.num_bytes, outcome.seconds, 0.0, time.monotonic() - t0 - compute_s,
                             seq.num_cached_prefix, split, prompt_logprobs.to_wire(seq))

    def _wait_terminal(self, rid: str, deadline: float, cancelled: Callable[[], str] = _never) -> TransferStatus:
        while True:
            st = self.tx.poll(rid)
            if st.terminal:
                return st
            why = cancelled()
            if why:
                self.tx.abort(rid, FailureReason.ABORTED, why)
            elif time.monotonic() > deadline:
                self.tx.abort(rid, FailureReason.DEADLINE, "transfer did not finish before its deadline")
            time.sleep(0.0005)
