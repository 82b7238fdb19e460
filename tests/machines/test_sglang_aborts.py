"""SGLang's scheduler aborts a request with a status or a grammar error: the call ends with the status the
reference servicer answers (``wire/sglang.py`` ``abort_outcome``), not as an engine failure.

Frames are real SGLang messages (the codec's engine side), decoded by the front-end codec and fed to
the request core; the error is the one ``runtime/errors.py`` maps the core's ``Failure`` to.
"""

from __future__ import annotations

import pytest
from grpclib.const import Status

from enginelink.machines.link import LinkEvent, LinkMachine
from enginelink.machines.ranks import RankTable
from enginelink.machines.request_api import Actions, GenerateCall, Refusal
from enginelink.machines.request_core import RequestCore
from enginelink.runtime.errors import CONSTRAINT_FAILED_METADATA, from_failure
from enginelink.wire import sglang
from enginelink.wire.engine import GenerateSpec, SamplingSpec

CODEC = sglang.SglangCodec()


def _core() -> RequestCore:
    link = LinkMachine("sglang-0", 0.0)
    link.handle(LinkEvent.HANDSHAKE_DONE, 0.0)
    link.handle(LinkEvent.WARMUP_DONE, 0.0)
    return RequestCore(link=link, ranks=RankTable((0,)), logprobs=CODEC.logprobs)


def _admit(core: RequestCore, rid: str, n: int = 1, constraint: str | None = None):
    ids = [rid if n == 1 else f"{rid}#{i}" for i in range(n)]
    specs = [GenerateSpec(request_id=e, prompt_token_ids=[5, 6], sampling=SamplingSpec(max_tokens=4)) for e in ids]
    actions = Actions()
    call = core.admit(GenerateCall(rid, True, [5, 6], specs, max_tokens=4, engine_ids=ids, constraint=constraint),
                      0.0, actions)
    assert not isinstance(call, Refusal)
    core.added(call, 0.0, actions)
    return call


def _feed(core: RequestCore, message) -> Actions:
    actions = Actions()
    core.on_batch(CODEC.decode_output(sglang.encode_outputs(message)), 1.0, actions)
    return actions


def _aborted_in_batch(rid: str, reason: dict):
    return sglang.token_batch([rid], [[]], [reason], prompt_tokens=[2], completion_tokens=[0])


@pytest.mark.parametrize("status, code", [(400, Status.INVALID_ARGUMENT), (503, Status.UNAVAILABLE),
                                          (429, Status.RESOURCE_EXHAUSTED), (500, Status.INTERNAL)])
def test_a_batch_abort_with_a_status_ends_the_call_with_that_status(status, code):
    core = _core()
    call = _admit(core, "a", n=2)
    actions = _feed(core, _aborted_in_batch("a#0", sglang.finish_abort("the input is too long", status)))
    error = from_failure(call.failure)
    assert (error.status, str(error)) == (code, "the input is too long")
    assert actions.aborts == [(0, ["a#1"])]  # the other choice is stopped on the engine; the aborted one is not
    assert not call.machine.open


def test_a_reported_abort_req_without_status_is_internal_and_a_plain_cancel_stays_unavailable():
    core = _core()
    call = _admit(core, "b")
    _feed(core, sglang.s.AbortReq(rid="b", finished_reason={"type": "abort", "message": "queue full",
                                                              "status_code": 503}))
    assert from_failure(call.failure).status == Status.UNAVAILABLE
    core2 = _core()
    call2 = _admit(core2, "c")
    _feed(core2, _aborted_in_batch("c", sglang.finish_abort("gone")))  # no status: the engine gave it up itself
    assert call2.failure.kind == "engine" and from_failure(call2.failure).status == Status.UNAVAILABLE


@pytest.mark.parametrize("reason", [
    sglang.finish_abort("token 7 rejected", 500, sglang.GRAMMAR_ERR_TYPE),  # the ranks' hooks stamp err_type
], ids=["err_type"])
def test_a_grammar_abort_is_a_constraint_failure_with_the_engine_trailer(reason):
    core = _core()
    call = _admit(core, "g", constraint="sampling_params.regex")
    _feed(core, _aborted_in_batch("g", reason))
    error = from_failure(call.failure)
    assert error.status == Status.FAILED_PRECONDITION
    assert error.trailing_metadata == (CONSTRAINT_FAILED_METADATA,)
    assert "sampling_params.regex" in str(error) and "token 7" in str(error)


def test_a_grammar_abort_is_never_attributed_by_its_wording():
    # Stock SGLang's unnamed aborts keep their status: a rejected token's 500 is INTERNAL, a grammar that does
    # not compile is the client's 400; only the ranks' own name (err_type) makes a constraint failure.
    for reason, status in ((sglang.finish_abort("Grammar accept_token failed for token 7", 500,
                                                "InternalServerError"), Status.INTERNAL),
                           (sglang.finish_abort("Failed to compile json_schema grammar: bad", 400,
                                                "BadRequestError"), Status.INVALID_ARGUMENT)):
        core = _core()
        call = _admit(core, "w", constraint="sampling_params.json_schema")
        _feed(core, _aborted_in_batch("w", reason))
        error = from_failure(call.failure)
        assert error.status == status and getattr(error, "trailing_metadata", ()) != (CONSTRAINT_FAILED_METADATA,)


def test_the_schedulers_reasoning_token_count_reaches_the_complete():
    # SGLang counts a choice's thinking tokens (a running total); decoded, then read at the choice's end.
    from enginelink.runtime.contracts.sglang.edge import encode_complete

    core = _core()
    call = _admit(core, "think")
    _feed(core, sglang.token_batch(["think"], [[7, 8]], [None], prompt_tokens=[2], completion_tokens=[2],
                                   reasoning_tokens=[2]))
    _feed(core, sglang.token_batch(["think"], [[9, 10]], [sglang.finish_length(4)], prompt_tokens=[2],
                                   completion_tokens=[4], reasoning_tokens=[3]))
    (complete,) = [m for m in call.take_messages() if type(m).__name__ == "Complete"]
    assert complete.reasoning_tokens == 3
    assert encode_complete(complete).complete.reasoning_tokens == 3
