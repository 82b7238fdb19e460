"""The request core and its one table: every state a call can be in, reached; every other event refused.

``machines/request.py``'s ``CALL_TABLE`` is the product of a call's life
(journaled) and its writer; ``machines/request_core.py`` decides with it,
sans-io: these tests drive it with plain events and read its actions, with
no hub, no protobuf and no event loop.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from enginelink.journal.records import (
    KIND_CLIENT_ABORT,
    KIND_CLIENT_GENERATE,
    KIND_CLIENT_SENT,
    KIND_ENGINE_REQUEST,
    KIND_TRANSITION,
)
from enginelink.journal.states import RequestState, WriterState
from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.machines.request import (
    CALL_TABLE,
    REQUEST_TABLE,
    RequestEvent,
    RequestMachine,
    WriterEvent,
    state_name,
)
from enginelink.machines.request_api import Actions, Chunk, Complete, GenerateCall, Refusal
from enginelink.machines.request_core import RequestCore
from enginelink.machines.table import ProtocolError
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, SamplingSpec

EVENTS = [*RequestEvent, *WriterEvent]


def _paths() -> dict[str, list[str]]:
    """The shortest event path from the initial state to each state the table can reach."""
    start = CALL_TABLE.initial
    paths = {start: []}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        for (source, event), dest in CALL_TABLE.steps.items():
            if source == state and dest not in paths:
                paths[dest] = [*paths[state], event]
                queue.append(dest)
    return paths


def _machine_in(state: str) -> RequestMachine:
    machine = RequestMachine("r", 0.0)
    for event in _paths()[state]:
        if event in set(RequestEvent):
            machine.handle(RequestEvent(event), 1.0)
        else:
            machine.writer_step(WriterEvent(event))
    assert machine.key == state
    return machine


def test_every_state_of_the_table_is_reached():
    paths = _paths()
    assert set(paths) == set(CALL_TABLE.states)
    # Every (life, writer) pair except a free id (writer done) on a call still open.
    expected = {state_name(life, writer) for life in RequestState for writer in WriterState}
    expected -= {state_name(life, WriterState.DONE) for life in (RequestState.ADMITTED, RequestState.RUNNING)}
    assert set(CALL_TABLE.states) == expected


@pytest.mark.parametrize("state", sorted(CALL_TABLE.states))
def test_each_state_takes_what_the_table_allows_and_refuses_the_rest(state):
    for event in EVENTS:
        machine = _machine_in(state)
        allowed = CALL_TABLE.allows(state, event)
        step = (lambda: machine.handle(event, 2.0)) if isinstance(event, RequestEvent) else (
            lambda: machine.writer_step(event))
        if allowed:
            step()
            assert machine.key == CALL_TABLE.steps[(state, event)]
        else:
            with pytest.raises(ProtocolError) as refused:
                step()
            assert refused.value.state == state and refused.value.event == str(event)
            assert machine.key == state, "a refused event leaves the state as it was"


def test_the_life_half_is_the_journaled_table_and_the_writer_half_is_never_journaled():
    machine = RequestMachine("r", 0.0)
    machine.writer_step(WriterEvent.WAKE)
    transition = machine.handle(RequestEvent.FIRST_OUTPUT, 1.0)
    assert (transition.source, transition.dest) == ("admitted", "running")
    assert machine.writer is WriterState.WOKEN  # a life event keeps the writer where it was
    for (source, event), dest in REQUEST_TABLE.steps.items():
        assert CALL_TABLE.steps[(state_name(RequestState(source), WriterState.IDLE), event)] == \
            state_name(RequestState(dest), WriterState.IDLE)
    # An open call's id is never freed: the writer leaving first is a bug, refused.
    with pytest.raises(ProtocolError):
        machine.writer_step(WriterEvent.RELEASE)


# -- the core's decisions ------------------------------------------------------------------


def _core(ranks=(0,), in_flight_max=8):
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    return RequestCore(link=link, ranks=RankTable(ranks), in_flight_max=in_flight_max,
                       logprobs=lambda out, frames: (None, None))


def _call(rid: str, n: int = 1, stream: bool = True, max_tokens: int = 4) -> GenerateCall:
    ids = [rid if n == 1 else f"{rid}#{i}" for i in range(n)]
    specs = [GenerateSpec(request_id=e, prompt_token_ids=[5, 6], sampling=SamplingSpec(max_tokens=max_tokens))
             for e in ids]
    return GenerateCall(rid, stream, [5, 6], specs, max_tokens=max_tokens, engine_ids=ids)


def _out(engine_id, tokens, finish=None, stop_reason=None):
    return SimpleNamespace(request_id=engine_id, new_token_ids=tokens, stop_reason=stop_reason,
                           finish_reason=None if finish is None else int(finish), kv_transfer_params=None)


def _admit(core, spec):
    actions = Actions()
    call = core.admit(spec, 0.0, actions)
    assert not isinstance(call, Refusal), call
    core.added(call, 0.0, actions)
    assert [r[2] for r in actions.records] == [KIND_CLIENT_GENERATE, KIND_ENGINE_REQUEST]
    return call


def test_a_frame_touches_each_call_once_and_a_finished_call_is_taken_whole():
    core = _core()
    call = _admit(core, _call("a", n=2))
    actions = Actions()
    core.on_batch(OutputBatch(0, [_out("a#0", [11]), _out("a#1", [21]), _out("a#0", [12], FinishReason.LENGTH)]),
                  1.0, actions)
    assert actions.touched == [call], "one write or wake per call per engine frame"
    assert [r[3]["dest"] for r in actions.records if r[2] == KIND_TRANSITION] == ["running"]
    taken = Actions()
    messages = core.take(call, 1.5, taken)
    # The counts are running ones (what MLX's and SGLang's chunks carry): two tokens of choice 0, one of choice 1.
    assert messages == [Chunk(0, [11, 12], 2, 0, completion_tokens=2),
                        Complete(0, [11, 12], "length", 2, 0, stream=True, completion_tokens=2),
                        Chunk(1, [21], 2, 0, completion_tokens=1)]
    assert [r[3]["index"] for r in taken.records if r[2] == KIND_CLIENT_SENT] == [0]
    assert call.machine.key == "running:busy"
    core.written(call)
    assert call.machine.key == "running:idle" and call.writable


def test_writer_states_follow_the_fan_out_and_the_writer():
    core = _core()
    call = _admit(core, _call("a"))
    core.woken(call)
    assert call.machine.writer is WriterState.WOKEN and not call.writable
    core.take(call, 1.0, Actions())
    core.woken(call)  # more came while it was writing
    assert call.machine.writer is WriterState.BUSY_WOKEN
    core.written(call)
    assert call.machine.writer is WriterState.WOKEN, "it takes again before the fan-out may write"
    core.take(call, 1.0, Actions())
    core.written(call)
    core.left_behind(call)
    assert call.machine.writer is WriterState.BACKLOG and not call.writable
    actions = Actions()
    core.on_batch(OutputBatch(0, [_out("a", [7], FinishReason.STOP, stop_reason=2)]), 2.0, actions)
    messages = core.take(call, 2.0, actions)
    assert messages[-1].finish_reason == "stop" and messages[-1].matched_token_id == 2
    assert call.machine.key == "finished:done" and "a" not in core.writing and "a" not in core.calls


def test_a_call_whose_writer_has_completes_to_take_keeps_its_id():
    core = _core()
    call = _admit(core, _call("a"))
    core.on_batch(OutputBatch(0, [_out("a", [7], FinishReason.LENGTH)]), 1.0, Actions())
    assert core.writing == {"a": call}
    assert core.admit(_call("a"), 1.0, Actions()).kind == "duplicate"
    core.take(call, 1.0, Actions())
    assert core.writing == {} and not isinstance(core.admit(_call("a"), 2.0, Actions()), Refusal)


def test_abort_ends_open_choices_sends_one_abort_per_rank_and_retires_their_ids():
    core = _core(ranks=(0, 1))
    call = _admit(core, _call("a", n=2))
    actions = Actions()
    assert core.abort(["a", "unknown"], "abort_rpc", 1.0, actions) == 1
    assert sorted(actions.aborts) == [(0, ["a#0"]), (1, ["a#1"])]
    assert actions.wake == [call] and [r[2] for r in actions.records][:1] == [KIND_CLIENT_ABORT]
    assert call.machine.state is RequestState.ABORTED
    assert [m.finish_reason for m in core.take(call, 1.0, Actions())] == ["abort", "abort"]
    # A retry of the same id gets fresh engine ids: the engine may still answer the old ones.
    again = core.admit(_call("a", n=2), 2.0, Actions())
    assert again.spec.engine_ids == ["a#0~1", "a#1~1"] and core.renamed == 1
    late = Actions()
    core.on_batch(OutputBatch(0, [_out("a#0", [9])]), 2.5, late)
    assert late.touched == [] and core.late_outputs == 1


def test_a_stop_string_ends_the_choice_and_aborts_its_engine_request():
    core = _core()
    # A word-level tokenizer: ids 1, 2, 3, 4 decode as "a b c d" (the words joined by spaces).
    core.tokenizer = Tokenizer.from_str(_tiny_tokenizer())
    spec = _call("a")
    spec.stop_strings = ("b c",)
    call = _admit(core, spec)
    actions = Actions()
    core.on_batch(OutputBatch(0, [_out("a", [1, 2, 3, 4])]), 1.0, actions)
    assert actions.aborts == [(0, ["a"])]
    assert call.machine.state is RequestState.FINISHED
    (chunk, complete) = core.take(call, 1.0, Actions())
    assert chunk.token_ids == [1, 2, 3] and complete.matched_stop_str == "b c"
    assert complete.output_ids == [1, 2, 3], "the tokens up to the one completing the stop string"


def _tiny_tokenizer() -> str:
    import json

    vocab = {chr(ord("a") + i - 1) if i else "<unk>": i for i in range(8)}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    })  # fmt: skip


def test_engine_failures_name_their_kind_and_free_every_rank():
    core = _core(ranks=(0, 1))
    constrained = _call("c", n=2)
    constrained.constraint, constrained.grammar_backend = "sampling_params.regex", "xgrammar"
    c = _admit(core, constrained)
    plain = _admit(core, _call("p"))
    actions = Actions()
    core.on_batch(OutputBatch(0, [_out("c#0", [], FinishReason.ERROR), _out("p", [], FinishReason.ABORT)]), 1.0,
                  actions)
    # vLLM's ERROR names no cause (a failed KV load, an encoder-cache miss end so too): a constrained call's
    # ends like any other's, never inferred to be the constraint's (that takes the engine's own attribution).
    assert c.failure is None and c.choices[0].finish_reason == "error" and c.machine.open
    assert plain.failure.kind == "engine" and "aborted the request itself" in plain.failure.message
    assert actions.aborts == [], "the other choice of the constrained call runs on"
    core.on_batch(OutputBatch(0, [_out("c#1", [], FinishReason.LENGTH)]), 1.5, Actions())
    assert c.failure is None and not c.machine.open
    assert core.ranks.in_flight == {0: 0, 1: 0}
    left = _admit(core, _call("l"))
    gone = Actions()
    assert core.fail_all("engine gone", 2.0, gone) == 1
    assert gone.wake == [left] and left.machine.state is RequestState.FAILED and left.done


def test_refusals_say_why():
    core = _core(in_flight_max=1)
    _admit(core, _call("a"))
    assert core.admit(_call("b"), 0.0, Actions()).reason == "capacity"
    spec = _call("s")
    spec.stop_strings = ("x",)
    core.in_flight_max = 8
    assert core.admit(spec, 0.0, Actions()).reason == "no_tokenizer"
    core.link.handle(LinkEvent.DRAIN, 1.0)
    refusal = core.admit(_call("d"), 1.0, Actions())
    assert refusal.kind == "unavailable" and refusal.reason == "draining"
