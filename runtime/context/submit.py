"""One servicer-made request through the hub, from trio code: the warm-up's and SGLang's health probe's.

``hub_submit(hub, limits)`` gives ``submit(request, timeout_s)``: the
``WarmupRequest`` (``machines/warmup.py``) built straight into a validated
call (no protobuf), admitted, waited for and taken, its answer an
``Outcome`` ("ok", "failed", "refused"). A caller that goes away
(cancellation: the warm-up driver's deadline, the server stopping, a health
probe's bound) aborts it at the engine. ``TrioWake`` is what the hub sets
to wake trio code (the hub's wake is an ``asyncio.Event`` for grpclib handlers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from enum import StrEnum

import trio

from enginelink.machines.request_api import GenerateCall
from enginelink.machines.warmup import WarmupRequest
from enginelink.runtime.errors import DuplicateRequest, ServicerError, Unavailable
from enginelink.runtime.requests.pd_bootstrap import stand_in_params
from enginelink.runtime.requests.validate import EngineLimits
from enginelink.wire.engine import GenerateSpec, SamplingSpec


class Outcome(StrEnum):
    OK = "ok"
    FAILED = "failed"  # abort/error complete, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, engine gone
    REFUSED = "refused"  # admission said no (retryable)
    TIMEOUT = "timeout"  # the driver's deadline ran out; counted as failed


Submit = Callable[[WarmupRequest, float], Awaitable[str]]


def warmup_call(request: WarmupRequest, limits: EngineLimits, now: float) -> GenerateCall:
    """The validated call a warm-up request stands for (built directly: no protobuf)."""
    prompt = request.prompt_token_ids
    sampling = SamplingSpec(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        eos_token_ids=limits.eos_token_ids,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=True,
    )
    spec = GenerateSpec(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        arrival_time=now,
        data_parallel_rank=request.data_parallel_rank,
        # On an SGLang PD leg: the engine's own stand-in bootstrap (a transfer to nobody), its room the rank
        # the request is pinned to, so a prefill leg's residue places it there (pd_bootstrap.py).
        kv_transfer_params=stand_in_params(limits.pd_leg, request.data_parallel_rank),
    )
    return GenerateCall(
        request_id=request.request_id,
        stream=False,
        prompt_token_ids=prompt,
        specs=[spec],
        max_tokens=request.max_tokens,
        engine_ids=[request.request_id],
    )


class TrioWake:
    """The part of ``asyncio.Event`` the hub uses (``set``), waking trio code instead.

    The hub sets ``call.wake`` from the link's receive task (trio) and from
    handlers (asyncio under trio-asyncio, same thread); a trio task cannot
    await an ``asyncio.Event``, so warm-up calls get this in its place.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = trio.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def clear(self) -> None:
        if self._event.is_set():
            self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


def hub_submit(hub, limits: EngineLimits) -> Submit:
    """``submit`` for ``run_warmup`` through a ``RequestHub`` (admission, journal, engine)."""

    async def submit(request: WarmupRequest, timeout_s: float) -> str:
        now = trio.current_time()
        try:
            wake = TrioWake()
            call = hub.admit(warmup_call(request, limits, now), now, wake=wake)
        except (Unavailable, DuplicateRequest):
            return Outcome.REFUSED
        except ServicerError:
            return Outcome.FAILED
        reasons = []
        try:
            while call.error is None and not all(choice.finished for choice in call.choices):
                await wake.wait()
                wake.clear()
        finally:
            # Cancelled (the driver's deadline, or the server stopping): stop the engine's work.
            now = trio.current_time()
            if call.machine.open:
                hub.abort([request.request_id], "warmup_cancelled", now)
            if call.error is None:
                # Journals the choices' ends (client.sent) and frees the id; nothing is sent.
                taken = [c for c in call.choices if not c.complete_sent]
                hub.take(call, now)
                reasons = [c.finish_reason for c in taken if c.complete_sent]
        return Outcome.FAILED if not reasons or any(r in ("abort", "error") for r in reasons) else Outcome.OK

    return submit
