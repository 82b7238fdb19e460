"""Resuming after an engine restart, sans-io: the link's table, the budget, the continuation, the core's holds.

``machines/resume.py`` decides what is re-sent and when restarts stop;
``machines/request_resume.py`` holds, re-submits or fails the core's calls.
No hub, no engine: the tests drive the core with plain events and read its
actions (the simulation and the real engines run the whole).
"""

from __future__ import annotations

import pytest

from enginelink.journal.records import KIND_ENGINE_HELD, KIND_ENGINE_RESUME, KIND_ERROR
from enginelink.journal.states import LinkState, RequestState
from enginelink.machines.link import LINK_TABLE, LinkEvent, LinkMachine, admission_refusal
from enginelink.machines.logprobs import PromptLogprobs
from enginelink.machines.ranks import RankTable
from enginelink.machines.request_api import Actions
from enginelink.machines.request_core import RequestCore
from enginelink.machines.resume import ResumePolicy, RestartBudget, continuation, unresumable
from enginelink.machines.table import ProtocolError
from enginelink.wire.engine import FinishReason, GenerateSpec, OutputBatch, SamplingSpec
from tests.machines.test_request_core import _admit, _call, _out


def test_the_link_restarts_only_from_serving_and_back_to_serving():
    assert LINK_TABLE.allows(LinkState.SERVING, LinkEvent.CRASH)
    assert LINK_TABLE.allows(LinkState.RESTARTING, LinkEvent.CRASH)  # the new engine died too
    assert LINK_TABLE.next_state("l", LinkState.RESTARTING, LinkEvent.RESTARTED) == LinkState.SERVING
    assert LINK_TABLE.next_state("l", LinkState.RESTARTING, LinkEvent.FAIL) == LinkState.FAILED
    assert LINK_TABLE.next_state("l", LinkState.RESTARTING, LinkEvent.DRAIN) == LinkState.DRAINING
    for state in (LinkState.STARTING, LinkState.WARMING_UP, LinkState.DRAINING):
        assert not LINK_TABLE.allows(state, LinkEvent.CRASH), state  # restarts apply while serving only
    machine = LinkMachine("l", 0.0)
    with pytest.raises(ProtocolError):
        machine.handle(LinkEvent.RESTARTED, 1.0)
    machine.handle(LinkEvent.HANDSHAKE_DONE, 1.0)
    machine.handle(LinkEvent.WARMUP_DONE, 1.0)
    machine.handle(LinkEvent.CRASH, 2.0, "engine died")
    assert (machine.healthy, machine.ready, machine.health_message) == (False, False, "Engine is restarting")
    assert machine.failure is None and machine.live
    assert "restarting" in admission_refusal(LinkState.RESTARTING, "client-1")
    assert admission_refusal(LinkState.RESTARTING, "smg-warmup-3") is None  # the restart's own warm-up


def test_the_budget_grants_n_restarts_per_window_then_says_why_not():
    budget = RestartBudget(ResumePolicy(restarts_max=2, window_s=60.0))
    assert budget.crashed(0.0) is None and budget.crashed(10.0) is None
    why = budget.crashed(20.0)
    assert why is not None and "3 crashes within 60 s" in why and "ENGINELINK_ENGINE_RESTARTS=2" in why
    assert budget.crashed(61.0) is None  # the crash at 0 left the window
    assert budget.restarts == 3 and len(budget.crashes) == 2


def test_policy_bounds_are_checked():
    assert not ResumePolicy().enabled
    for bad in ({"restarts_max": -1}, {"restarts_max": 101}, {"window_s": 0}, {"resume_timeout_s": -1},
                {"media_items_max": -1}):
        with pytest.raises(ValueError):
            ResumePolicy(**bad)


def _spec(**sampling) -> GenerateSpec:
    return GenerateSpec(request_id="r", prompt_token_ids=[5, 6],
                        sampling=SamplingSpec(max_tokens=sampling.pop("max_tokens", 10), **sampling))


def test_the_continuation_is_the_prompt_plus_the_tokens_with_the_counts_reduced():
    spec = _spec(min_tokens=4, prompt_logprobs=2, logprobs=1, seed=7)
    cont = continuation(spec, [9, 8, 7], prompt_logprobs_sent=True)
    assert cont.request_id == "r" and cont.prompt_token_ids == [5, 6, 9, 8, 7]
    assert (cont.sampling.max_tokens, cont.sampling.min_tokens) == (7, 1)
    assert cont.sampling.prompt_logprobs is None and cont.sampling.logprobs == 1 and cont.sampling.seed == 7
    assert continuation(spec, [], prompt_logprobs_sent=False) == spec  # nothing yet: re-sent as it was
    assert continuation(spec, [1] * 6, prompt_logprobs_sent=False).sampling.min_tokens == 0
    with pytest.raises(ValueError):
        continuation(spec, [1] * 10, prompt_logprobs_sent=False)


def test_what_cannot_be_continued_exactly_says_why():
    policy = ResumePolicy(restarts_max=1, media_items_max=1)
    decode_leg = GenerateSpec(request_id="d", prompt_token_ids=[5], sampling=SamplingSpec(max_tokens=4),
                              kv_transfer_params={"do_remote_prefill": True})
    prefill_leg = GenerateSpec(request_id="p", prompt_token_ids=[5], sampling=SamplingSpec(max_tokens=1),
                               kv_transfer_params={"do_remote_decode": True})
    assert "PD decode leg" in unresumable(decode_leg, 0, policy)
    assert unresumable(prefill_leg, 0, policy) is None
    media = GenerateSpec(request_id="m", prompt_token_ids=[5], sampling=SamplingSpec(max_tokens=4), mm_features=[1, 2])
    assert "ENGINELINK_RESUME_MEDIA_ITEMS_MAX=1" in unresumable(media, 0, policy)
    grammar = _spec(structured_outputs={"regex": "a+"})
    assert unresumable(grammar, 0, policy) is None and "grammar" in unresumable(grammar, 2, policy)
    assert "penalties" in unresumable(_spec(presence_penalty=0.5), 1, policy)
    assert unresumable(_spec(repetition_penalty=1.2, logit_bias={3: 1.0}), 1, policy) is None
    assert "max_tokens" in unresumable(_spec(max_tokens=3), 3, policy)


def _resuming_core(ranks=(0,)):
    link = LinkMachine("sim-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    return RequestCore(link=link, ranks=RankTable(ranks), logprobs=lambda out, frames: (None, None),
                       resume=ResumePolicy(restarts_max=2))


def test_held_calls_resume_their_open_choices_from_their_tokens_and_finished_ones_stay_done():
    core = _resuming_core(ranks=(0, 1))
    call = _admit(core, _call("n", n=3, stream=True, max_tokens=6))
    actions = Actions()
    core.on_batch(OutputBatch(0, [_out("n#0", [11, 12]), _out("n#1", [21], FinishReason.STOP), _out("n#2", [31])]),
                  1.0, actions)
    held = Actions()
    assert core.hold_all("engine died", 2.0, held) == (1, 0)
    assert [r[2] for r in held.records] == [KIND_ENGINE_HELD]
    assert held.records[0][3]["engine_ids"] == ["n#0", "n#2"] and held.records[0][3]["tokens"] == [2, 1]
    assert core.ranks.in_flight == {0: 0, 1: 0} and "n#0" not in core.by_engine_id
    assert call.machine.open and core.held == {"n": call}
    [(resumed, sends)] = core.resume_held(3.0)
    assert resumed is call
    assert [(choice.index, spec.prompt_token_ids, spec.sampling.max_tokens) for choice, spec in sends] == [
        (0, [5, 6, 11, 12], 4), (2, [5, 6, 31], 5)]
    done = Actions()
    core.resumed(call, sends, 3.0, done)
    [record] = done.records
    assert record[2] == KIND_ENGINE_RESUME and record[3]["reprefilled"] == [2, 1] and record[3]["indexes"] == [0, 2]
    assert core.held == {} and call.resumes == 1 and core.reprefilled_tokens == 3 and core.resumed_requests == 1
    # The new engine's tokens continue the choices' counts and streams.
    later = Actions()
    core.on_batch(OutputBatch(0, [_out("n#0", [13, 14, 15, 16], FinishReason.LENGTH),
                                  _out("n#2", [32, 33, 34, 35, 36], FinishReason.LENGTH)]), 4.0, later)
    assert call.machine.state is RequestState.FINISHED
    assert [c.output for c in call.choices] == [[11, 12, 13, 14, 15, 16], [21], [31, 32, 33, 34, 35, 36]]
    assert [c.tokens_engine for c in call.choices] == [6, 1, 6]


def test_a_call_in_flight_at_a_second_crash_fails_and_one_never_resent_stays_held():
    core = _resuming_core()
    first = _admit(core, _call("a"))
    core.hold_all("crash 1", 1.0, Actions())
    [(call, sends)] = core.resume_held(2.0)
    core.resumed(call, sends, 2.0, Actions())
    second = _admit(core, _call("b"))
    failed = Actions()
    assert core.hold_all("crash 2", 3.0, failed) == (1, 1)
    assert first.machine.state is RequestState.FAILED and "in flight at 2 engine crashes" in first.failure.message
    assert [r[2] for r in failed.records if r[2] == KIND_ERROR] == [KIND_ERROR]
    assert core.resume_failures == 1
    # Crash 3 while the new engine starts: "b" was never on it, and stays held.
    assert core.hold_all("crash 3", 4.0, Actions()) == (0, 0)
    assert core.held == {"b": second} and second.held_at == 3.0


def test_held_calls_fail_past_the_timeout_and_an_abort_frees_one_without_a_frame():
    core = _resuming_core()
    early, late = _admit(core, _call("e")), _admit(core, _call("l"))
    core.hold_all("crash", 1.0, Actions())
    core.held["l"].held_at = 2.0  # held later (a call held at another crash)
    assert core.fail_held("timed out", 3.5, Actions(), waited_s=2.0) == 1
    assert early.machine.state is RequestState.FAILED and early.failure.message == "timed out"
    gone = Actions()
    assert core.abort(["l"], "client_gone", 3.6, gone) == 1
    assert gone.aborts == [] and core.held == {} and late.machine.state is RequestState.ABORTED


def test_a_choice_whose_prompt_logprobs_were_sent_does_not_ask_them_again():
    core = _resuming_core()
    spec = _call("p")
    spec.specs = [GenerateSpec(request_id="p", prompt_token_ids=[5, 6],
                               sampling=SamplingSpec(max_tokens=4, logprobs=1, prompt_logprobs=1))]
    call = _admit(core, spec)
    call.choices[0].logprobs.prompt = PromptLogprobs(1, [5, 6], [])  # delivered with the first output
    call.choices[0].output = [9]
    core.hold_all("crash", 1.0, Actions())
    [(_, [(_, cont)])] = core.resume_held(2.0)
    assert cont.sampling.prompt_logprobs is None and cont.sampling.logprobs == 1 and cont.prompt_token_ids == [5, 6, 9]


def test_a_pd_decode_leg_fails_at_the_crash_naming_why():
    core = _resuming_core()
    spec = _call("d")
    spec.specs = [GenerateSpec(request_id="d", prompt_token_ids=[5, 6], sampling=SamplingSpec(max_tokens=4),
                               kv_transfer_params={"do_remote_prefill": True})]
    call = _admit(core, spec)
    failed = Actions()
    assert core.hold_all("engine process 7 exited with status -9", 1.0, failed) == (0, 1)
    assert call.failure.kind == "engine"
    assert call.failure.message.startswith("engine process 7 exited with status -9; the request is not resumed: "
                                           "a PD decode leg")
    assert failed.wake == [call]


def test_an_sglang_or_tokenspeed_pd_leg_is_not_resumed_even_before_its_first_token():
    """Both legs of an SGLang/TokenSpeed pair run at once and meet by bootstrap room: a leg re-sent to a
    new engine would wait on (decode) or send to (prefill) a peer whose transfer the crash broke."""
    policy = ResumePolicy(restarts_max=1)
    for mode in ("prefill", "decode"):
        leg = GenerateSpec(request_id=mode, prompt_token_ids=[5], sampling=SamplingSpec(max_tokens=4),
                           kv_transfer_params={"bootstrap_host": "10.0.0.2", "bootstrap_port": 8998,
                                               "bootstrap_room": 17})
        assert "bootstrap room" in unresumable(leg, 0, policy)
        assert "bootstrap room" in unresumable(leg, 2, policy)


def test_an_sglang_request_with_router_images_is_resumed_only_before_its_first_token():
    """SGLang's router-preprocessed image (``mm_inputs``) is a processor output for the prompt as sent (its
    padded ids and positions): re-sent as it was, it is exact; with generated tokens appended, it is not."""
    policy = ResumePolicy(restarts_max=1)
    image = GenerateSpec(request_id="i", prompt_token_ids=[5, 6], sampling=SamplingSpec(max_tokens=4),
                         mm_inputs={"mm_items": []})
    assert unresumable(image, 0, policy) is None
    assert "image" in unresumable(image, 1, policy)
