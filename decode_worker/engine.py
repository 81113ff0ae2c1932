"""DecodeEngine: the engine core plus admission of sequences whose KV a prefill worker pushes.

Request lifecycle on a decode worker:
  AdmitRequest  -> look the prompt up in the prefix cache; reserve pages for the rest now (or
                   Rejected: no room / too long), register them with the KV receiver, return the
                   TransferRequest bytes (kv_target) and the cached prefix length: the prefill
                   worker ships only the pages after it
  StartDecode   -> prompt ids, sampling and the first token arrive (from the router, after prefill)
  transfer DONE -> the sequence joins continuous batching with num_cached = prompt_len
  FAILED / deadline / Abort -> the request ends with an error; its pages return to the pool only
                   when the receiver says no peer can still write into them (fail-closed); KV that
                   landed but whose StartDecode never came (router gone) is freed at the deadline
  Abort of a running or waiting sequence -> its pages are freed now, before the next step
  GenerateRequest (colocated, or a short uncached suffix) -> a normal sequence that prefills here,
                   from its cached prefix (the scheduler looks it up)
Finished sequences' blocks (prompt and output) stay cached until evicted (model/prefix_cache.py),
so the next turn of a conversation needs only its new tokens' KV.
Steps run overlapped (engine.core): each returns one TokenBatch per router connection.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from common.errors import InvalidRequest, TandemError
from engine import prompt_logprobs
from engine.build import EngineParts
from engine.core import EngineCore
from engine.sampling import SamplingParams, check_request, to_params
from engine.sequence import FinishReason, Sequence, TokenLogprob, attach_grammar
from kv_transfer.interface import KVReceiver, TransferStatus
from kv_transfer.messages import encode as encode_kv
from model.kv_cache import SeqPages
from model.prefix_cache import Hit
from wire.protocol import (
    MAX_RESERVATION_S,
    AdmitRequest,
    Admitted,
    GenerateRequest,
    Rejected,
    StartDecode,
    TokenBatch,
    TokenChunk,
    TopLogprob,
)

log = logging.getLogger("tandem.decode")


LANDED_WAIT_S = 60.0  # KV landed, no StartDecode yet: the pages are freed this long after (the router is gone)


@dataclass(slots=True)
class Pending:
    """Pages reserved, KV on its way. `start` arrives from the router once prefill finished."""

    request_id: str
    peer: bytes
    pages: SeqPages
    prompt_len: int
    deadline: float
    start: StartDecode | None = None
    prompt_ids: list[int] | None = None  # as admitted (StartDecode must match), with their block hashes
    block_hashes: list[int] | None = None
    cached_tokens: int = 0


def chunk_of(seq: Sequence, n_new: int, cached_tokens: int = 0, first_local: bool = False) -> TokenChunk:
    """The sequence's last n_new tokens. The first chunk of a GenerateRequest (`first_local`) also
    says what its prefill took here: the cached prefix, the wait for its first step, and that step's
    launch to its token on the host (engine.core stamps first_launch)."""
    new = seq.output_ids[-n_new:] if n_new else []
    lps = seq.logprobs[-n_new:] if (n_new and seq.params.logprobs is not None) else []
    queue_s = prefill_s = 0.0
    if first_local and seq.first_launch is not None:
        queue_s, prefill_s = seq.first_launch - seq.arrival, time.monotonic() - seq.first_launch
    return TokenChunk(seq.request_id, new, [lp.logprob for lp in lps],
                      [[TopLogprob(t, v) for t, v in lp.top] for lp in lps], seq.finished,
                      seq.finish_reason.value if seq.finish_reason else "", "", cached_tokens, queue_s, prefill_s,
                      prompt_logprobs.to_wire(seq) if first_local else None)


class DecodeEngine:
    def __init__(self, parts: EngineParts, receiver: KVReceiver | None, overlap: bool = True) -> None:
        self.parts, self.rx = parts, receiver
        self.kv, self.scheduler = parts.kv, parts.scheduler
        self.core = EngineCore(parts.scheduler, parts.runner, overlap)
        self.vocab_size = parts.model.cfg.vocab_size
        self.pending: dict[str, Pending] = {}
        self.peers: dict[str, bytes] = {}  # request id -> router socket identity
        self.seqs: dict[str, Sequence] = {}
        self.local: set[str] = set()  # GenerateRequests that have not streamed their first chunk

    # ---- admission --------------------------------------------------------------------------------
    def admit(self, peer: bytes, m: AdmitRequest) -> Admitted | Rejected:
        if self.rx is None:
            return Rejected(m.request_id, "this decode worker has no KV transfer backend", False)
        if m.request_id in self.peers or m.request_id in self.pending:
            return Rejected(m.request_id, "request id already in use on this worker", False)
        if not (m.prompt_len >= 1 and m.max_tokens >= 1 and 0 < m.deadline_s <= MAX_RESERVATION_S):
            return Rejected(m.request_id, f"admission needs prompt_len >= 1, max_tokens >= 1 and a deadline in "
                                          f"(0, {MAX_RESERVATION_S:.0f}] s", False)
        try:
            self.scheduler.check_fits(m.prompt_len, m.max_tokens)
        except InvalidRequest as e:
            return Rejected(m.request_id, e.message, False)
        probe = (Sequence(m.request_id, list(m.prompt_ids), SamplingParams())
                 if len(m.prompt_ids) == m.prompt_len else None)
        hit = self._decode_hit(probe, m.prompt_len)
        pages = SeqPages()
        if hit.num_tokens:
            full, sliding = self.kv.room_for_hit(hit, m.prompt_len + 1)
        else:
            full, sliding = self.kv.pages_needed(pages, m.prompt_len + 1)
        free_full, free_sliding = self.kv.num_free()
        if full + len(self.scheduler.running) > free_full or sliding > free_sliding \
                or len(self.scheduler.running) + len(self.pending) >= self.scheduler.cfg.max_num_seqs:
            return Rejected(m.request_id, f"no KV room for {m.prompt_len} tokens right now", True)
        if hit.num_tokens:
            self.kv.map_hit(pages, hit, m.prompt_len)
        else:
            self.kv.grow(pages, m.prompt_len)
        if probe is not None and self.kv.cache is not None:
            self.kv.cache.count(m.prompt_len, hit.num_tokens)
        deadline = time.time() + m.deadline_s
        try:
            req = self.rx.expect(m.request_id, pages, m.prompt_len, deadline, hit.num_tokens)
        except TandemError as e:  # nothing was promised to a peer: the pages go straight back
            self.kv.release(pages)
            return Rejected(m.request_id, f"KV receiver refused the request: {e.message}", True)
        self.pending[m.request_id] = Pending(m.request_id, peer, pages, m.prompt_len, deadline, None,
                                             probe.prompt_ids if probe else None,
                                             probe.block_hashes if probe else None, hit.num_tokens)
        self.peers[m.request_id] = peer
        return Admitted(m.request_id, self.rx.epoch, encode_kv(req), hit.num_tokens)

    def _decode_hit(self, probe: Sequence | None, n: int) -> Hit:
        """The cached prefix of an admitted prompt, its sliding blocks trimmed to those the first
        decode step reads: blocks before (n - W + 1) // P are dead for it, and copying them could
        land in ring slots the transfer writes."""
        if probe is None or self.kv.cache is None:
            return Hit()
        hit = self.scheduler.lookup(probe)
        spec = self.kv.spec
        need = max(0, n - spec.sliding_window + 1) // spec.page_size
        hit.sliding = {j: pg for j, pg in hit.sliding.items() if j >= need}
        return hit

    def start(self, peer: bytes, m: StartDecode) -> TokenChunk | None:
        p = self.pending.get(m.request_id)
        if p is None:
            return TokenChunk(m.request_id, [], [], [], True, "abort", "unknown request (expired or aborted)")
        if p.start is not None:
            return None  # a repeated StartDecode: the first one stands
        why = ""
        if len(m.prompt_ids) != p.prompt_len or (p.prompt_ids is not None and m.prompt_ids != p.prompt_ids):
            why = "prompt differs from admission"
        else:
            try:
                params = to_params(m.sampling)
                check_request(m.prompt_ids + [m.first_token], params, self.vocab_size)
                attach_grammar(Sequence(m.request_id, [], params))  # the schemas compile (cached for _activate)
            except InvalidRequest as e:
                why = e.message
        if why:
            self.abort(m.request_id, why)
            return TokenChunk(m.request_id, [], [], [], True, "abort", why)
        p.start, self.peers[m.request_id] = m, peer
        return None

    def generate(self, peer: bytes, m: GenerateRequest, received: float | None = None) -> TokenChunk | None:
        """A prompt to prefill here; `received` (monotonic) starts its TTFT breakdown's queue time."""
        if m.request_id in self.peers or m.request_id in self.pending:
            return TokenChunk(m.request_id, [], [], [], True, "abort", "request id already in use on this worker")
        try:
            params = to_params(m.sampling)
            check_request(m.prompt_ids, params, self.vocab_size)
            seq = Sequence(m.request_id, list(m.prompt_ids), params,
                           arrival=received if received is not None else time.monotonic())
            attach_grammar(seq)
            self.scheduler.add(seq)
        except InvalidRequest as e:
            return TokenChunk(m.request_id, [], [], [], True, "abort", e.message)
        self.seqs[m.request_id] = seq
        self.peers[m.request_id] = peer
        self.local.add(m.request_id)
        return None

    def abort(self, request_id: str, reason: str) -> None:
        """End a request wherever it is: a reservation (its transfer fails, pages back once no
        writer can touch them; landed KV freed now), a waiting or running sequence (pages freed now)."""
        p = self.pending.pop(request_id, None)
        if p is not None:
            self._drop_reservation(p, reason)
        self.local.discard(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.core.abort(seq)
            self.parts.sampler.forget(request_id)
        self.peers.pop(request_id, None)

    def abort_all(self, reason: str) -> list[tuple[bytes, TokenChunk]]:
        """End every request this worker holds (the drain deadline): each gets a final chunk with
        finish_reason "abort" and `reason`, and its pages go back as in abort()."""
        out = []
        for rid in list(dict.fromkeys([*self.pending, *self.seqs])):
            peer = self.peers.get(rid) or (self.pending[rid].peer if rid in self.pending else None)
            if peer is not None:
                out.append((peer, TokenChunk(rid, [], [], [], True, "abort", reason)))
            self.abort(rid, reason)
        return out

    def _drop_reservation(self, p: Pending, reason: str) -> None:
        assert self.rx is not None
        if self.rx.poll(p.request_id) == TransferStatus.DONE:  # landed: nobody writes any more
            self.rx.finish(p.request_id)
            self.kv.release(p.pages)
        else:  # fail-closed: take_releasable() hands the pages back once every writer stopped
            self.rx.abort(p.request_id, detail=reason)

    # ---- the step ---------------------------------------------------------------------------------
    def poll_transfers(self) -> list[tuple[bytes, TokenChunk]]:
        """Move landed sequences into batching; report failures. Returns chunks to send."""
        if self.rx is None:
            return []
        self.rx.progress()
        out = []
        for rid, p in list(self.pending.items()):
            st = self.rx.poll(rid)
            if st == TransferStatus.DONE and p.start is None:
                # The reservation outlived the prefill's compute (router: prefill timeout + transfer deadline);
                # once the KV is here the router's StartDecode follows at once, so a long wait means it is gone
                p.deadline = min(p.deadline, time.time() + LANDED_WAIT_S)
            if st == TransferStatus.FAILED:
                o = self.rx.outcome(rid)
                self.pending.pop(rid)
                peer = self.peers.pop(rid, p.peer)
                out.append((peer, TokenChunk(rid, [], [], [], True, "abort", f"kv transfer failed: {o.reason.label if o.reason else ''} {o.detail}")))
            elif st == TransferStatus.DONE and p.start is not None:
                self.rx.finish(rid)
                self.pending.pop(rid)
                out += self._activate(p)
            elif st == TransferStatus.DONE and p.start is None and time.time() > p.deadline:
                why = "KV landed but no StartDecode came before the deadline"  # the router is gone
                self.pending.pop(rid)
                self._drop_reservation(p, why)
                out.append((self.peers.pop(rid, p.peer), TokenChunk(rid, [], [], [], True, "abort", why)))
            elif p.start is None and time.time() > p.deadline:  # reported as FAILED on a later poll
                self.rx.abort(rid, detail="no StartDecode before the deadline")
        for rel in self.rx.take_releasable():
            self.kv.release(rel.pages)
        return out

    def _activate(self, p: Pending) -> list[tuple[bytes, TokenChunk]]:
        m = p.start
        assert m is not None
        seq = Sequence(p.request_id, list(m.prompt_ids), to_params(m.sampling), arrival=time.monotonic(),
                       pages=p.pages, num_cached=p.prompt_len)
        spec = self.kv.spec
        # valid sliding KV: what the first decode step reads (copied from the cache or transferred)
        seq.ring_valid_from = max(0, p.prompt_len - spec.sliding_window + 1) // spec.page_size * spec.page_size
        seq.block_hashes = p.block_hashes or []
        seq.num_cached_prefix = p.cached_tokens
        seq.output_ids.append(m.first_token)
        attach_grammar(seq)  # caught up with the prompt tail and the first token
        if m.first_logprob is not None:
            seq.logprobs.append(TokenLogprob(m.first_token, m.first_logprob, [(t.token_id, t.logprob) for t in m.first_top]))
        reason = self.scheduler.stop_reason(seq, m.first_token)
        if reason is not None:  # the first token already ends it (stop token or max_tokens == 1)
            self.scheduler.finish(seq, reason)  # releases the pages; the sequence never runs here
            return [(self.peers.pop(seq.request_id), TokenChunk(seq.request_id, [], [], [], True, reason.value, ""))]
        self.seqs[seq.request_id] = seq
        self.scheduler.add_running(seq)
        if seq.params.share_prompt:  # n > 1: the other choices find the landed prompt in this worker's cache
            self.scheduler.share_prompt(seq)
        return []

    def step(self) -> list[tuple[bytes, TokenBatch]]:
        """One engine iteration; the new tokens as one TokenBatch per router connection."""
        if not self.core.has_work:
            return []
        by_peer: dict[bytes, list[TokenChunk]] = {}
        for seq in self.core.step():
            peer = self.peers.get(seq.request_id)
            if peer is not None:
                first = seq.request_id in self.local
                self.local.discard(seq.request_id)
                by_peer.setdefault(peer, []).append(chunk_of(seq, 1, seq.num_cached_prefix if first else 0, first))
            if seq.finished:
                self.local.discard(seq.request_id)
                self.seqs.pop(seq.request_id, None)
                self.peers.pop(seq.request_id, None)
                self.parts.sampler.forget(seq.request_id)
        return [(peer, TokenBatch(chunks)) for peer, chunks in by_peer.items()]

    @property
    def has_work(self) -> bool:
        return self.core.has_work or bool(self.pending)
