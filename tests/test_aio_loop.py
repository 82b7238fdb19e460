"""The asyncio loop under grpclib runs its ready callbacks together (runtime/rpc/fastpath.py), and stays an asyncio loop."""

from __future__ import annotations

import asyncio

import trio
import trio_asyncio

from enginelink.runtime.rpc.fastpath import READY_CALLBACKS_MAX, run_ready_callbacks_together


async def test_callbacks_run_in_order_timers_fire_and_tasks_finish():
    async with trio_asyncio.open_loop() as loop:
        run_ready_callbacks_together(loop)
        order: list[object] = []

        async def body() -> str:
            aio_loop = asyncio.get_running_loop()
            for i in range(500):
                aio_loop.call_soon(order.append, i)
            fired = asyncio.Event()
            aio_loop.call_later(0.01, fired.set)
            await asyncio.wait_for(fired.wait(), 5)
            task = asyncio.ensure_future(asyncio.sleep(0, "done"))
            return await task

        assert await trio_asyncio.aio_as_trio(body)() == "done"
        assert order == list(range(500))


async def test_ready_callbacks_run_together_but_a_flood_does_not_keep_trio_tasks_waiting():
    async with trio_asyncio.open_loop() as loop:
        stats = run_ready_callbacks_together(loop)
        callbacks_before_trio_ran: list[int] = []
        ran = 0

        def flood() -> None:
            nonlocal ran
            ran += 1
            if ran < 20 * READY_CALLBACKS_MAX:
                asyncio.get_running_loop().call_soon(flood)  # always one more ready

        async def start_flood() -> None:
            asyncio.get_running_loop().call_soon(flood)

        await trio_asyncio.aio_as_trio(start_flood)()
        for _ in range(8):
            await trio.sleep(0)
            callbacks_before_trio_ran.append(ran)
        # Between two turns of this trio task the loop ran a pass or two: whole passes of ready
        # callbacks (the point; one callback a pass without it), each bounded, and the flood
        # was still going while this task ran.
        steps = [b - a for a, b in zip(callbacks_before_trio_ran, callbacks_before_trio_ran[1:])]
        assert READY_CALLBACKS_MAX <= max(steps) <= 2 * (READY_CALLBACKS_MAX + 1), callbacks_before_trio_ran
        assert callbacks_before_trio_ran[-1] < 20 * READY_CALLBACKS_MAX
        # ... and the passes that stopped at the bound are counted (exported in /metrics).
        assert stats.ready_callbacks_max == READY_CALLBACKS_MAX and stats.full_passes >= 2


async def test_the_loop_still_stops_cleanly_with_work_queued():
    leftover: list[int] = []
    async with trio_asyncio.open_loop() as loop:
        run_ready_callbacks_together(loop)

        async def queue_and_return() -> None:
            for i in range(3 * READY_CALLBACKS_MAX):
                asyncio.get_running_loop().call_soon(leftover.append, i)

        await trio_asyncio.aio_as_trio(queue_and_return)()
    # Everything queued before the loop closed ran, in order (as trio-asyncio promises).
    assert leftover == list(range(3 * READY_CALLBACKS_MAX))
