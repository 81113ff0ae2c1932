"""SplitClock: where a prefill request's compute time goes (wire.protocol.ComputeSplit).

    engine.run ── admit ──► launch(chunk) ── collect ──► ... the next chunk ... ──► first token
                  host:      host queues the     host waits
                  lookup,    forward (metadata,  for the GPU
                  mapping,   plan, every kernel,
                  tx.start   per-layer hooks)

A prefill whose host time (admit + launch) is close to its compute time is host-bound: the GPU
waits for kernels to be queued. A large hook share is the KV sender's bounded run-ahead waiting
for layer i - max_layers_ahead (kv_transfer/nixl_sender.py): the GPU is behind the host.

On CUDA two timing events bracket the device's view: one recorded before the first launch, one
behind the last launch (after the first token's device -> host copy). Their span holds the
request's kernels, plus whatever the GPU did meanwhile that was not this request's work: waiting
for the host to queue the next kernel, or running another process (a GPU shared with a decode
worker is time-sliced). Comparing it with the same request's span on an idle GPU
(benchmarks/prefill_prefix.py) separates the two.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from wire.protocol import ComputeSplit


class SplitClock:
    def __init__(self, t0: float, device: torch.device) -> None:
        self.t0 = t0  # time.monotonic() when the request's compute began
        self.cuda = torch.device(device).type == "cuda"
        self.admit = self.launch = self.hooks = 0.0
        self._first: torch.cuda.Event | None = None
        self._last: torch.cuda.Event | None = None
        self._started = False

    def launching(self) -> float:
        """Call right before a forward launch; returns the launch's start (for `launched`)."""
        now = time.monotonic()
        if not self._started:
            self._started = True
            self.admit = now - self.t0
            if self.cuda:
                self._first = torch.cuda.Event(enable_timing=True)
                self._first.record()
        return now

    def launched(self, since: float) -> None:
        """Call right after a launch returned (its kernels and the token copy are queued)."""
        self.launch += time.monotonic() - since
        if self.cuda:
            self._last = torch.cuda.Event(enable_timing=True)
            self._last.record()

    def timed(self, hook: Callable[[int], None] | None) -> Callable[[int], None] | None:
        """The per-layer hook, its time added to `hooks` (also when it raises to leave the forward)."""
        if hook is None:
            return None

        def timed_hook(layer: int) -> None:
            t = time.monotonic()
            try:
                hook(layer)
            finally:
                self.hooks += time.monotonic() - t
        return timed_hook

    def split(self) -> ComputeSplit:
        """After the last collect: the request's split (its last event has run by then)."""
        gpu = 0.0
        if self._first is not None and self._last is not None:
            self._last.synchronize()
            gpu = self._first.elapsed_time(self._last) / 1e3
        return ComputeSplit(self.admit, self.launch, self.hooks, gpu)
