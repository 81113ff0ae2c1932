"""n > 1: one request, n choices, each its own job through the orchestrator, merged into one stream
of (choice index, item).

Choice 0 starts alone, flagged `share_prompt`; the other n - 1 start when choice 0 has yielded its
second chunk (or ended): that chunk comes from the decode worker's own step, so by then its prompt's
KV exists there (computed there, or landed from the prefill worker: the first token, which the
prefill worker samples, can reach the router before the decode worker has seen its KV land) and it
has indexed it in its prefix cache while
choice 0 keeps decoding (model/prefix_share.py: full blocks shared by reference, the sliding window's
blocks copied into cache-owned pages), and the router's prefix index predicts it there, so placement
sends the later choices to that decode worker, which prefills only the prompt's last partial block
locally (at most page_size - 1 tokens). Measured on the CPU stack with a 203-token prompt and n = 4:
prompt tokens computed 236 = 203 + 3 x 11, KV shipped once (disaggregated) or never (colocated),
where n separate requests computed 812 (benchmarks/results/2026-12-02/cpu-grammar-1/README.md).
A TP worker does not share early (its runner cannot copy pages on every rank): there the later
choices hit the prefill worker's cache instead and each gets the prompt's KV shipped.

Cancellation: closing the merged generator (client gone, timeout, drain) cancels every choice's
pump; each pump's generator then runs its own `finally` (Abort to the workers).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()
START_AFTER = 2  # choice 0's items before the others start (module doc)


async def fan_out(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of every generator as (index, item), in arrival order; the first error ends it all."""
    if len(gens) == 1:  # n = 1, nearly every request: no pump task, one event-loop hop less per token
        try:
            async for x in gens[0]:
                yield 0, x
        finally:
            await gens[0].aclose()  # type: ignore[attr-defined]
        return
    q: asyncio.Queue = asyncio.Queue()  # bounded by the choices' max_tokens

    async def pump(i: int, g: AsyncIterator[T]) -> None:
        try:
            async for x in g:
                q.put_nowait((i, x, None))
            q.put_nowait((i, _DONE, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put_nowait((i, _DONE, e))
        finally:
            await g.aclose()  # type: ignore[attr-defined]

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(pump(0, gens[0]))]
    remaining, seen0 = len(gens), 0
    try:
        while remaining:
            i, x, err = await q.get()
            if err is not None:
                raise err
            seen0 += i == 0
            if len(tasks) == 1 < len(gens) and (seen0 >= START_AFTER or x is _DONE):  # choice 0's prompt is shared
                tasks += [loop.create_task(pump(j, g)) for j, g in enumerate(gens[1:], start=1)]
            if x is _DONE:
                remaining -= 1
                continue
            yield i, x
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
