"""The DP rank table, and the hub sending each engine request, and its abort, to one rank.

The choice rule is vLLM 0.32's ``DPLBAsyncMPClient.get_core_engine_for_request``
with one client and no coordinator: the fewest requests in flight, scanned from
a start that moves on by one per unpinned pick (ties go round-robin).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.runtime.requests.hub import RequestHub
from enginelink.runtime.contracts.vllm.edge import validate_generate
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire import vllm
from enginelink.wire.engine import FinishReason, OutputBatch
from enginelink.wire.vllm import VllmCodec
from tests.harness import ListJournal, generate_request

LIMITS = EngineLimits(max_model_len=2048, vocab_size=4096, eos_token_ids=(2,), data_parallel_size=3)


def test_ties_go_round_robin_and_load_wins_over_order():
    table = RankTable((0, 1, 2))
    assert [table.pick() for _ in range(3)] == [0, 1, 2]  # each pick counts, so the next is the least loaded
    assert table.in_flight == {0: 1, 1: 1, 2: 1}
    table.ended(1)
    assert table.pick() == 1  # the least loaded, wherever the scan starts
    table.ended(0)
    table.ended(2)
    # 0 and 2 tie at 0: the scan starts where the rotation is (after 4 unpinned picks: 4 % 3 = 1), so 2 comes first.
    assert table.pick() == 2
    assert table.pick() == 0


def test_idle_ranks_alternate_for_sequential_requests():
    table = RankTable((0, 1))
    picks = []
    for _ in range(6):
        rank = table.pick()
        picks.append(rank)
        table.ended(rank)
    assert picks == [0, 1, 0, 1, 0, 1]


def test_a_pin_is_honoured_counted_and_does_not_move_the_rotation():
    table = RankTable((0, 1))
    assert [table.pick(1), table.pick(1), table.pick(1)] == [1, 1, 1]
    assert table.in_flight == {0: 0, 1: 3}
    assert table.pick() == 0
    assert table.snapshot() == {0: {"in_flight": 1, "sent": 1}, 1: {"in_flight": 3, "sent": 3}}


def test_a_pin_is_a_place_in_the_ranks_and_ends_never_go_negative():
    table = RankTable((3,))  # a one-rank engine told it is rank 3: pin 0 is that rank
    assert table.size == 1
    assert table.pick(0) == 3
    table.ended(3)
    table.ended(3)
    assert table.in_flight == {3: 0}
    assert RankTable().size == 1 and RankTable().pick() == 0  # before the handshake names the ranks


def _hub(ranks=(0, 1)):
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    sent: list[tuple[int, bytes, object]] = []

    def send(frames, rank):
        payload = msgspec.msgpack.decode(frames[1])
        sent.append((rank, frames[0], payload))

    hub = RequestHub(link=link, codec=VllmCodec(), send_frames=send, journal=ListJournal(), ranks=RankTable(ranks))
    return hub, sent


def _admit(hub, rid: str, n: int = 1, pin: int | None = None):
    request = generate_request(rid, [5, 6, 7], stream=True, max_tokens=4, n=n, seed=1)
    if pin is not None:
        request.data_parallel_rank = pin
    return hub.admit(validate_generate(request, LIMITS, 0.0), 0.0, wake=asyncio.Event())


def _out(engine_id: str, finish: FinishReason | None = None):
    return SimpleNamespace(request_id=engine_id, new_token_ids=[9],
                           finish_reason=None if finish is None else int(finish), stop_reason=None,
                           kv_transfer_params=None)


def test_the_hub_sends_each_choice_to_its_rank_and_the_abort_to_the_same_ranks():
    hub, sent = _hub((0, 1, 2))
    call = _admit(hub, "a", n=2)
    pinned = _admit(hub, "b", pin=2)
    assert [(rank, kind) for rank, kind, _ in sent] == [(0, vllm.REQ_ADD), (1, vllm.REQ_ADD),
                                                         (2, vllm.REQ_ADD)]
    assert [c.rank for c in call.choices] == [0, 1] and pinned.choices[0].rank == 2
    sent.clear()
    hub.abort(["a"], "client", 1.0)
    # One ABORT per rank holding a choice, naming only that rank's engine request.
    assert sorted((rank, ids) for rank, kind, ids in sent if kind == vllm.REQ_ABORT) == [
        (0, ["a#0"]), (1, ["a#1"])]
    assert hub.ranks.in_flight == {0: 0, 1: 0, 2: 1}


def test_a_finished_or_failed_choice_frees_its_rank_once():
    hub, _ = _hub()
    call = _admit(hub, "a")
    rank = call.choices[0].rank
    assert hub.ranks.in_flight[rank] == 1
    hub.on_batch(OutputBatch(rank, [_out("a", FinishReason.LENGTH)]), 1.0)
    assert hub.ranks.in_flight == {0: 0, 1: 0}
    _admit(hub, "b")
    _admit(hub, "c")
    assert hub.ranks.in_flight == {0: 1, 1: 1}
    hub.fail_all("engine gone", 2.0)
    hub.abort(["b", "c"], "late", 3.0)  # already ended: nothing released twice
    assert hub.ranks.in_flight == {0: 0, 1: 0}


def test_an_abort_the_engine_made_itself_fails_the_call_unavailable_and_aborts_its_other_choices():
    """vLLM aborts requests itself only when it stops (its DP launcher stops every rank when one dies):
    the client must see the engine's failure (UNAVAILABLE, retryable), not a normal ``abort`` end."""
    hub, sent = _hub()
    call = _admit(hub, "a", n=2)
    sent.clear()
    hub.on_batch(OutputBatch(0, [_out("a#0", FinishReason.ABORT)]), 1.0)
    assert call.error is not None and call.error.status.name == "UNAVAILABLE"
    assert "aborted the request itself" in str(call.error)
    assert not call.machine.open and hub.active_requests == 0
    # The other choice, on the other rank, is stopped there; the aborted one is not aborted again.
    assert [(rank, ids) for rank, kind, ids in sent if kind == vllm.REQ_ABORT] == [(1, ["a#1"])]
    assert hub.ranks.in_flight == {0: 0, 1: 0}
