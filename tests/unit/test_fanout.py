"""router.fanout: n choices merged with their index; the later choices start only once choice 0 has
yielded twice; closing the merged stream (client gone) closes every choice; an error ends it all."""

import asyncio

import pytest

from router.fanout import fan_out


def run(coro):
    return asyncio.run(coro)


def test_merge_tags_items_and_starts_the_rest_after_choice_0():
    started: list[int] = []

    async def gen(i: int, n: int):
        started.append(i)
        for k in range(n):
            await asyncio.sleep(0)
            yield f"{i}.{k}"

    async def main():
        out = []
        async for i, x in fan_out([gen(0, 3), gen(1, 2), gen(2, 2)]):
            if len(out) < 2:
                assert started == [0]  # choice 0's first two items come before the others start
            out.append((i, x))
        return out

    out = run(main())
    assert sorted(out) == [(0, "0.0"), (0, "0.1"), (0, "0.2"), (1, "1.0"), (1, "1.1"), (2, "2.0"), (2, "2.1")]


def test_closing_the_merged_stream_closes_every_choice():
    closed: list[int] = []

    async def gen(i: int):
        try:
            while True:
                await asyncio.sleep(0.001)
                yield i
        finally:
            closed.append(i)

    async def main():
        merged = fan_out([gen(0), gen(1)])
        seen = set()
        async for i, _ in merged:
            seen.add(i)
            if seen == {0, 1}:
                break
        await merged.aclose()

    run(main())
    assert sorted(closed) == [0, 1]


def test_an_error_in_any_choice_ends_the_stream():
    async def ok():
        while True:
            await asyncio.sleep(0.001)
            yield "x"

    async def bad():
        yield "y"
        raise ValueError("worker lost")

    async def main():
        async for _ in fan_out([ok(), bad()]):
            pass

    with pytest.raises(ValueError, match="worker lost"):
        run(main())
