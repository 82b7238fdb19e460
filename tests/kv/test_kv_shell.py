"""The relay's trio shell without sockets, on trio's MockClock: streams, wakes, load records, heartbeats.

Publisher messages go straight to ``relay.on_live`` through the shell's
action handling; streams are opened, pulled and beaten as the gRPC handler
does it. Virtual time makes the heartbeat schedule exact to a ticker tick.
"""

from __future__ import annotations

import trio
import trio.testing

from enginelink.machines.kv_relay_api import KvRelayConfig
from enginelink.runtime.contracts.shared.kv_messages import batch_message
from enginelink.runtime.kv.kv_config import KvPlan, RankEndpoints
from enginelink.runtime.kv.kv_loads import CHECK_S, LoadSource
from enginelink.runtime.kv.kv_relay import KvRelayShell
from enginelink.runtime.context.loads import Loads
from enginelink.runtime.context.submit import TrioWake
from enginelink.wire import kv_events as kv
from enginelink.wire.engine import SchedulerStats
from tests.machines.kv_pair import msg, stored

BASE = 1000


class ListJournal:
    def __init__(self) -> None:
        self.records: list[tuple[float, str, str, dict]] = []

    def append(self, now, stream, kind, payload) -> int:
        self.records.append((now, stream, kind, payload))
        return len(self.records)


def make_shell(window: int = 10_000, loads: Loads | None = None) -> KvRelayShell:
    plan = KvPlan(kv.KvEventsConfig(enable_kv_cache_events=True, topic="kv"), (RankEndpoints(0, None, False, None),),
                  False, KvRelayConfig(history_batches_max=window, replay=False))  # fmt: skip
    return KvRelayShell(plan, ListJournal(), LoadSource(loads or Loads(), limits=lambda: (4, 64)),
                        sequence_base=BASE, wall_time=lambda now: 5000.0 + now)  # fmt: skip


def sent(outgoing) -> list:
    """The relay's messages as a subscriber gets them (the handler encodes each so)."""
    return [batch_message(*message) for message in outgoing]


def publish(shell: KvRelayShell, seq: int) -> None:
    shell._apply(shell.relay.on_live(0, msg(seq, stored([seq + 1])), trio.current_time()))


async def test_a_stream_left_behind_ends_with_data_loss_and_holds_up_nobody():
    shell = make_shell(window=4)
    fast, slow = TrioWake(), TrioWake()
    a, b = shell.open_stream(0, True, fast), shell.open_stream(0, True, slow)
    for seq in range(10):
        publish(shell, seq)  # never waits for a stream
        assert fast.is_set() and slow.is_set()
        fast.clear()
        pulled = shell.pull(a)
        assert [x.sequence_number for x in pulled.batches] == [BASE + seq] and pulled.end is None
        message = batch_message(*shell.message(a, pulled.batches[0]))
        assert message.dp_rank == 0 and message.load.sample == seq + 1 and not message.load.load_only
    late = shell.pull(b)
    assert late.batches == () and late.end.status == "DATA_LOSS" and "behind" in late.end.message
    shell.close_stream(b)
    assert list(shell.streams) == [a.id]
    kinds = [kind for _, _, kind, _ in shell.journal.records]
    assert kinds.count("kv.batch") == 10


async def test_load_only_heartbeats_repeat_the_cursor_and_back_off(autojump_clock):
    loads = Loads()
    shell = make_shell(loads=loads)
    publish(shell, 0)
    wake = TrioWake()
    stream = shell.open_stream(BASE, False, wake)  # resumed at the newest: nothing to send, a cursor to repeat
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shell._ticker)
        start = trio.current_time()
        while len(times) < 5:
            await wake.wait()
            wake.clear()
            assert shell.pull(stream).batches == ()
            for beat in sent(shell.heartbeats(stream)):
                assert beat.sequence_number == BASE and beat.load.load_only and not beat.events
                assert beat.timestamp == 5000.0 + trio.current_time()
                assert beat.load.max_total_num_tokens == 64  # telemetry on every load_only record
                times.append(trio.current_time() - start)
            if len(times) == 3:
                loads.update(0, SchedulerStats(num_running_reqs=1), 0, trio.current_time())  # news: at once
        nursery.cancel_scope.cancel()
    expected = [CHECK_S, CHECK_S + 1, CHECK_S + 2, CHECK_S + 2.1, CHECK_S + 3.1]
    assert all(abs(t - e) <= CHECK_S + 1e-6 for t, e in zip(times, expected)), times
    assert times[4] - times[3] < 2  # a change resets the back-off: 1 s again, not 5


async def test_back_off_to_five_seconds_and_nothing_before_the_first_batch_unless_asked(autojump_clock):
    shell = make_shell()
    quiet, eager = TrioWake(), TrioWake()
    a = shell.open_stream(0, False, quiet)  # load_records_before_first_batch false
    b = shell.open_stream(0, True, eager)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shell._ticker)
        start = trio.current_time()
        times = []
        while len(times) < 4:
            await eager.wait()
            eager.clear()
            for beat in sent(shell.heartbeats(b)):
                assert beat.sequence_number == 0  # before any batch: numbered 0
                times.append(trio.current_time() - start)
        assert not quiet.is_set() and shell.heartbeats(a) == []
        nursery.cancel_scope.cancel()
    gaps = [y - x for x, y in zip(times, times[1:])]  # exact to a ticker tick
    assert all(abs(g - e) <= CHECK_S + 1e-6 for g, e in zip(gaps, [1.0, 1.0, 5.0])), gaps


async def test_close_ends_every_stream_unavailable():
    shell = make_shell()
    wake = TrioWake()
    stream = shell.open_stream(0, True, wake)
    shell.close()
    assert wake.is_set()
    end = shell.pull(stream).end
    assert end.status == "UNAVAILABLE"
    refused = shell.open_stream(0, True, TrioWake())
    assert refused.status == "UNAVAILABLE"


async def test_with_nobody_listening_the_ticker_sleeps_and_a_later_stream_sees_the_stats_age(autojump_clock):
    loads = Loads()
    shell = make_shell(loads=loads)
    views = []
    view = shell.loads.view
    shell.loads.view = lambda rank, now: views.append(rank) or view(rank, now)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shell._ticker)
        await trio.sleep(1.0)
        loads.update(0, SchedulerStats(num_running_reqs=3), 0, trio.current_time())  # nobody listening
        arrived = trio.current_time()
        # The ticker waits for a listener with no deadline of its own: an idle servicer without KV
        # subscribers is not woken ten times a second (the old ticker slept CHECK_S at a time).
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().seconds_to_next_deadline == float("inf")
        await trio.sleep(5.0)
        assert views == []  # no stream: no load views, no throughput window summed
        wake = TrioWake()
        stream = shell.open_stream(0, True, wake)  # the first listener, 5 s after the stats came
        await wake.wait()
        beats = sent(shell.heartbeats(stream))
        nursery.cancel_scope.cancel()
    assert views and beats and beats[0].load.running_requests == 3
    # Its age counts from when the stats arrived, not from when the stream looked.
    assert beats[0].load.age_ms == round((trio.current_time() - arrived) * 1000)
    assert beats[0].load.age_ms >= 5000


async def test_the_ticker_sleeps_again_once_the_last_stream_closes(autojump_clock):
    shell = make_shell()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shell._ticker)
        stream = shell.open_stream(0, True, TrioWake())
        await trio.sleep(1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().seconds_to_next_deadline <= CHECK_S  # ticking for the stream
        shell.close_stream(stream)
        await trio.sleep(2 * CHECK_S)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().seconds_to_next_deadline == float("inf")
        nursery.cancel_scope.cancel()
