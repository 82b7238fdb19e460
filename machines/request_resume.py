"""The request core's part in an engine restart: hold the open calls, re-submit them, or fail them saying why.

Methods of ``RequestCore`` (``request_core.py`` binds them), kept here so the
core's file holds the life of a call and this one its resumption. Their
``core`` is that ``RequestCore``, unannotated: the core imports this module,
and an import back, even for a type, would make the two a circle. Sans-io as
the core: events in, ``Actions`` out (journal records, calls to wake), never
a frame sent (the hub sends what ``resume_held`` returns).

Theory of operation (docs/resume.md). The engine died with restarts on:

- ``hold_all``: each open call is held (its open choices leave the routing
  table and their ranks, the engine that had them is gone), or fails now with
  why it cannot be resumed exactly (``resume.unresumable``; a warm-up call; a
  call already resumed once, ``RESUMES_MAX``). A call held since an earlier
  crash was never on the dead engine and stays held;
- the engine is back: ``resume_held`` gives, per held call, each open
  choice's continuation (``resume.continuation``: prompt plus the tokens the
  choice has, which are exactly those the client has or is being sent), its
  rank picked and its engine id routed again; the hub sends them and reports
  ``resumed`` (journaled, counted) or ``resume_unreachable``;
- ``fail_held``: the held calls that waited past the resume timeout (or all
  of them: the link failed, a drain began) fail with the message given.

The engine id of a resumed choice is its own again: the dead engine's
outputs cannot arrive any more (its sockets were closed with it), and the
new engine has never seen the id. Nothing about a held call's client side
changes: its writer waits as it would for a slow engine.
"""

from __future__ import annotations

from enginelink.journal.records import KIND_ENGINE_HELD, KIND_ENGINE_RESUME, KIND_ERROR, request_stream
from enginelink.machines.link import WARMUP_REQUEST_PREFIX
from enginelink.machines.request_api import Actions
from enginelink.machines.request_call import Call, Choice
from enginelink.machines.resume import RESUMES_MAX, continuation, unresumable
from enginelink.wire.engine import GenerateSpec


def hold_all(core, message: str, now: float, actions: Actions) -> tuple[int, int]:
    """The engine died (``message``) and will be started again: hold each open call, or fail it saying
    why it cannot be resumed. Returns (held, failed)."""
    held = failed = 0
    for call in list(core.calls.values()):
        if not call.machine.open or call.held_at is not None:
            continue
        why = _why_not(core, call)
        if why is not None:
            _fail(core, call, f"{message}; the request is not resumed: {why}", now, actions)
            failed += 1
            continue
        open_choices = [choice for choice in call.choices if not choice.finished]
        for choice in open_choices:
            core._release_rank(choice)
            core.by_engine_id.pop(choice.engine_id, None)
        call.held_at = now
        core.held[call.spec.request_id] = call
        actions.records.append((now, request_stream(call.spec.request_id), KIND_ENGINE_HELD, {
            "link": core.link.name, "request_id": call.spec.request_id,
            "engine_ids": [c.engine_id for c in open_choices], "tokens": [len(c.output or ()) for c in open_choices]}))
        held += 1
    return held, failed


def _why_not(core, call: Call) -> str | None:
    if core.resume is None:
        return "engine restarts are off"
    if call.spec.request_id.startswith(WARMUP_REQUEST_PREFIX):
        return "a warm-up request (the restart runs its own)"
    if call.resumes >= RESUMES_MAX:
        return (f"it was in flight at {call.resumes + 1} engine crashes (a request is resumed at most "
                f"{RESUMES_MAX} time{'s' if RESUMES_MAX > 1 else ''})")
    for choice, spec in zip(call.choices, call.spec.specs, strict=True):
        if not choice.finished:
            why = unresumable(spec, len(choice.output or ()), core.resume)
            if why is not None:
                return why if call.spec.n == 1 else f"choice {choice.index} is {why}"
    return None


def resume_held(core, now: float) -> list[tuple[Call, list[tuple[Choice, GenerateSpec]]]]:
    """The engine is back: every held call's open choices with their continuations, ranks picked,
    engine ids routed again. The shell sends them in order and reports ``resumed`` or ``resume_unreachable``."""
    out = []
    for call in list(core.held.values()):
        sends = []
        for choice, spec in zip(call.choices, call.spec.specs, strict=True):
            if choice.finished:
                continue
            lp = choice.logprobs
            sends.append((choice, continuation(spec, choice.output or [],
                                               prompt_logprobs_sent=lp is not None and lp.prompt is not None)))
            choice.rank = core.ranks.pick(spec.data_parallel_rank)
            core.by_engine_id[choice.engine_id] = (call, choice)
        out.append((call, sends))
    return out


def resumed(core, call: Call, sends: list[tuple[Choice, GenerateSpec]], now: float,
            actions: Actions) -> None:
    """Every continuation of ``call`` reached the link: it runs again."""
    core.held.pop(call.spec.request_id, None)
    call.held_at = None
    call.resumes += 1
    reprefilled = [len(spec.prompt_token_ids) - call.prompt_tokens for _, spec in sends]
    core.resumed_requests += 1
    core.reprefilled_tokens += sum(reprefilled)
    actions.records.append((now, request_stream(call.spec.request_id), KIND_ENGINE_RESUME, {
        "link": core.link.name, "request_id": call.spec.request_id,
        "engine_ids": [choice.engine_id for choice, _ in sends], "indexes": [choice.index for choice, _ in sends],
        "reprefilled": reprefilled, "prompt_tokens": [len(spec.prompt_token_ids) for _, spec in sends],
        "ranks": [choice.rank for choice, _ in sends], "resumes": call.resumes}))


def resume_unreachable(core, call: Call, sent: int, sends: list[tuple[Choice, GenerateSpec]],
                       error: str, now: float, actions: Actions) -> None:
    """The continuation ``sent`` of ``call`` could not be handed to the new engine (it is going away too):
    the ones before it are aborted, the call fails now."""
    core._abort_choices([choice for choice, _ in sends[:sent]], actions)
    _fail(core, call, f"the restarted engine is not reachable ({error}); retry on another worker", now, actions)


def fail_held(core, message: str, now: float, actions: Actions, *,
              waited_s: float | None = None) -> int:
    """Fail the held calls (those held ``waited_s`` or longer by ``now``, when given) with ``message``."""
    failed = 0
    for call in list(core.held.values()):
        if waited_s is None or call.held_at + waited_s <= now:
            _fail(core, call, message, now, actions)
            failed += 1
    return failed


def _fail(core, call: Call, message: str, now: float, actions: Actions) -> None:
    """One call the engine's death ends (UNAVAILABLE, retryable), its reason journaled beside it."""
    if not call.spec.request_id.startswith(WARMUP_REQUEST_PREFIX):
        core.resume_failures += 1
    actions.records.append((now, request_stream(call.spec.request_id), KIND_ERROR, {
        "whose": "engine", "code": "UNAVAILABLE", "message": message, "id": call.spec.request_id}))
    core._end_failed(call, message, now, actions)
