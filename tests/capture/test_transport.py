"""The default transport of `model.openai_client()`: requests dealt over several connection pools."""

from __future__ import annotations

import asyncio

from tempering.capture.transport import ShardedPoolTransport, httpx


def test_requests_are_dealt_over_the_pools_in_turn_and_all_are_closed():
    transport = ShardedPoolTransport(shards=3)
    seen: list[int] = []
    closed: list[int] = []

    def answering(index: int) -> httpx.MockTransport:
        mock = httpx.MockTransport(lambda request: (seen.append(index), httpx.Response(200, text=request.url.path))[1])

        async def aclose() -> None:
            closed.append(index)
        mock.aclose = aclose
        return mock

    transport.shards = [answering(i) for i in range(3)]

    async def run() -> list[str]:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            responses = await asyncio.gather(*(client.get(f"/r{i}") for i in range(7)))
        return [r.text for r in responses]

    assert asyncio.run(run()) == [f"/r{i}" for i in range(7)]
    assert sorted(seen) == [0, 0, 0, 1, 1, 2, 2] and sorted(closed) == [0, 1, 2]
