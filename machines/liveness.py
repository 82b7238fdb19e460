"""When to ask an idle engine whether it lives, and when its silence says it does not.

An engine with requests in flight proves it lives with every step it
reports; the link's silence limit watches that. An idle engine says nothing,
and a frozen one (SIGSTOP, a deadlocked loop, a hung driver) looks just the
same: health stayed SERVING and the next request waited the whole silence
limit (issue 21, item 9). So while the link serves with nothing in flight,
it asks the engine a cheap utility call (``is_sleeping``: vLLM's EngineCore
answers it from its busy loop, between steps) once the engine has been quiet
for ``interval_s``; an engine that sends nothing at all within ``timeout_s``
of a probe is dead, whatever happens meanwhile (a probe goes ahead of any
request on the same socket, and vLLM answers its inputs in order before its
next step, so a request that arrives later does not excuse the silence).

Any frame from the engine after a probe answers it: the probe's own reply,
or a step's output. Nothing is sent while requests are in flight (a long
prefill is silent and legitimate; the silence limit allows for it) or while
the link is not serving.

Sans-io: ``IdleProbe.poll(now, idle=…, last_frame_at=…)`` returns what the
shell does next: send a probe, fail the link, or wait until a time. It never
reads a clock. ``interval_s`` 0 turns probing off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple

# Defaults of ENGINELINK_IDLE_PROBE_SECS and ENGINELINK_IDLE_PROBE_TIMEOUT_SECS.
IDLE_PROBE_INTERVAL_S: Final = 5.0
IDLE_PROBE_TIMEOUT_S: Final = 30.0
# The utility method a probe calls: answered by vLLM 0.32's EngineCore and the sim engine, and cheap.
PROBE_METHOD: Final = "is_sleeping"


@dataclass(frozen=True)
class ProbeTiming:
    interval_s: float = IDLE_PROBE_INTERVAL_S  # quiet time before a probe; 0 = no probes
    timeout_s: float = IDLE_PROBE_TIMEOUT_S  # how long a probe may go unanswered


class ProbeSend(NamedTuple):
    """Send one probe now."""


class ProbeFailed(NamedTuple):
    """The engine sent nothing for ``unanswered_s`` after a probe: it is dead."""

    unanswered_s: float


class ProbeWait(NamedTuple):
    """Nothing to do before ``until`` (trio time)."""

    until: float


ProbeAction = ProbeSend | ProbeFailed | ProbeWait


class IdleProbe:
    """One engine link's idle probe: at most one probe outstanding."""

    __slots__ = ("timing", "sent_at", "probes_sent", "probes_answered")

    def __init__(self, timing: ProbeTiming) -> None:
        self.timing = timing
        self.sent_at: float | None = None  # the outstanding probe, if any
        self.probes_sent = 0
        self.probes_answered = 0  # sent minus answered: the probe outstanding now (0 or 1)

    def poll(self, now: float, *, idle: bool, last_frame_at: float) -> ProbeAction:
        """What to do at ``now``; ``idle``: serving with nothing in flight."""
        timing = self.timing
        if self.sent_at is not None:
            if last_frame_at >= self.sent_at:
                self.sent_at = None  # answered: the engine spoke after the probe
                self.probes_answered += 1
            elif now - self.sent_at >= timing.timeout_s:
                return ProbeFailed(now - self.sent_at)
            else:
                return ProbeWait(self.sent_at + timing.timeout_s)
        if timing.interval_s <= 0 or not idle:
            return ProbeWait(now + max(timing.interval_s, 1.0))
        due = last_frame_at + timing.interval_s
        if now < due:
            return ProbeWait(due)
        self.sent_at = now
        self.probes_sent += 1
        return ProbeSend()
