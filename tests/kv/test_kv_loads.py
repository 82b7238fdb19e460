"""Load records and ``load_only`` timing (``runtime/kv/kv_loads.py``): pure, time as an argument."""

from __future__ import annotations

import asyncio

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.contracts.shared.kv_messages import load_message
from enginelink.runtime.kv.kv_loads import Beat, LoadSource, LoadView, changed
from enginelink.runtime.context.loads import Loads
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import SchedulerStats
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal, generate_request

IDLE = LoadView(running=0, waiting=0, usage=0.0, rate=0.0, silence_s=None)


def record_of(source: LoadSource, rank: int, now: float, **kwargs):
    """The rank's load record as a subscriber gets it (the KV-events handler encodes it so)."""
    return load_message(source.record(rank, now, **kwargs))


def view(**fields) -> LoadView:
    return LoadView(**{**IDLE.__dict__, **fields})


def test_heartbeats_after_one_second_then_back_off_to_five_after_two_unchanged():
    beat = Beat()
    assert beat.due(IDLE, 0.0)  # the first record of a rank goes out at once
    beat.sent(IDLE, 0.0, load_only=False)  # a KV batch carried it
    assert not beat.due(IDLE, 0.9) and beat.due(IDLE, 1.0)
    beat.sent(IDLE, 1.0, load_only=True)
    assert not beat.due(IDLE, 1.9) and beat.due(IDLE, 2.0)
    beat.sent(IDLE, 2.0, load_only=True)  # two unchanged heartbeats: back off
    assert not beat.due(IDLE, 6.9) and beat.due(IDLE, 7.0)
    beat.sent(IDLE, 7.0, load_only=True)
    assert not beat.due(IDLE, 11.9) and beat.due(IDLE, 12.0)


def test_a_change_is_due_at_once_and_resets_the_back_off():
    beat = Beat()
    beat.sent(IDLE, 0.0, load_only=True)
    beat.sent(IDLE, 1.0, load_only=True)
    beat.sent(IDLE, 2.0, load_only=True)
    busy = view(running=1)
    assert beat.due(busy, 2.1)
    beat.sent(busy, 2.1, load_only=True)
    assert not beat.due(busy, 3.0) and beat.due(busy, 3.1)  # 1 s again
    beat.sent(busy, 3.1, load_only=False)
    assert beat.unchanged == 0


def test_what_counts_as_a_change():
    assert changed(IDLE, view(waiting=1))
    assert not changed(view(usage=0.100), view(usage=0.104)) and changed(view(usage=0.100), view(usage=0.106))
    assert not changed(view(rate=1000.0), view(rate=1040.0)) and changed(view(rate=1000.0), view(rate=1050.0))
    assert changed(view(rate=100.0), view(rate=106.0)) and not changed(view(rate=10.0), view(rate=10.5))
    assert changed(view(running=1, silence_s=0), view(running=1, silence_s=1))


def test_a_record_from_the_newest_stats():
    loads = Loads()
    source = LoadSource(loads, limits=lambda: (8, 1024), last_frame_at=lambda: 9.5, in_flight_since=lambda: 9.0,
                        prefill_pending=lambda: 7)  # fmt: skip
    empty = record_of(source, 0, 10.0, sample=1, load_only=True, telemetry=True)
    assert (empty.running_requests, empty.age_ms, empty.max_total_num_tokens) == (0, 0, 1024)
    loads.update(0, SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                                   prefix_cache_queries=10, prefix_cache_hits=5), 0, 10.0)  # fmt: skip
    assert source.view(0, 10.0) == LoadView(2, 1, 0.25, 0.0, 0)
    record = record_of(source, 0, 10.25, sample=2, load_only=False, telemetry=False)
    assert (record.running_requests, record.waiting_requests, record.token_usage) == (2, 1, 0.25)
    assert (record.age_ms, record.sample, record.load_only, record.max_running_requests) == (250, 2, False, 8)
    assert (record.engine_silence_ms, record.prefill_pending_tokens, record.engine_reports_steps) == (750, 7, True)
    assert not record.HasField("memory") and record.max_total_num_tokens == 0  # telemetry only when asked
    full = record_of(source, 0, 10.25, sample=3, load_only=True, telemetry=True)
    assert (full.cache_hit_rate, full.num_used_tokens, full.memory.token_capacity, full.queues.waiting) == (0.5, 256, 1024, 1)


def _source(last_frame_at: float | None, in_flight_since: float | None) -> LoadSource:
    return LoadSource(Loads(), limits=lambda: (8, 1024), last_frame_at=lambda: last_frame_at,
                      in_flight_since=lambda: in_flight_since)  # fmt: skip


def test_an_idle_engine_reports_no_silence():
    # Issue 22: the router vetoed an idle worker as "wedged" because every
    # heartbeat carried the time since the last frame. Nothing in flight: unset.
    source = _source(last_frame_at=10.0, in_flight_since=None)
    for now in (10.0, 13.0, 600.0):
        record = record_of(source, 0, now, sample=1, load_only=True, telemetry=True)
        assert not record.HasField("engine_silence_ms"), now
        assert source.view(0, now).silence_s is None


def test_before_the_engine_is_up_silence_is_unset_even_with_requests_waiting():
    record = record_of(_source(last_frame_at=None, in_flight_since=5.0), 0, 9.0, sample=1, load_only=True, telemetry=False)
    assert not record.HasField("engine_silence_ms")


def test_silence_counts_from_the_admission_of_the_oldest_request_after_an_idle_spell():
    # The engine was last heard at 10 s, idle until a request came at 100 s:
    # at 100.4 s it has been silent 0.4 s with work, not 90 s.
    source = _source(last_frame_at=10.0, in_flight_since=100.0)
    assert record_of(source, 0, 100.4, sample=1, load_only=True, telemetry=False).engine_silence_ms == 400
    assert source.view(0, 103.9).silence_s == 3


def test_silence_counts_from_the_last_frame_while_requests_are_in_flight():
    source = _source(last_frame_at=20.5, in_flight_since=20.0)
    assert record_of(source, 0, 24.0, sample=1, load_only=True, telemetry=False).engine_silence_ms == 3500
    assert source.view(0, 24.0).silence_s == 3


def test_a_heartbeat_is_not_due_when_only_idle_time_passes():
    # An idle engine's record does not change as time passes, so heartbeats back off.
    source, beat = _source(last_frame_at=0.0, in_flight_since=None), Beat()
    beat.sent(source.view(0, 0.0), 0.0, load_only=True)
    beat.sent(source.view(0, 1.0), 1.0, load_only=True)
    beat.sent(source.view(0, 2.0), 2.0, load_only=True)
    assert not beat.due(source.view(0, 6.9), 6.9)


def test_the_hub_names_the_oldest_call_in_flight():
    # What ``in_flight_since`` reads in the servicer: admission order, whatever order calls end in.
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    hub = RequestHub(link=link, codec=VllmCodec(), send_frames=lambda frames, rank=0: None, journal=ListJournal())
    limits = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,))
    assert hub.oldest_admitted_at() is None
    for request_id, now in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        spec = validate_generate(generate_request(request_id, [5, 6, 7], max_tokens=2), limits, now)
        hub.admit(spec, now, wake=asyncio.Event())
    hub.abort(["b"], "client", 4.0)
    assert hub.oldest_admitted_at() == 1.0
    hub.abort(["a"], "client", 5.0)
    assert hub.oldest_admitted_at() == 3.0
    hub.abort(["c"], "client", 6.0)
    assert hub.oldest_admitted_at() is None
