"""The engine link's and the hub's counters and bounds, as ``/metrics`` shows them (``smg_servicer_link_*``)."""

from __future__ import annotations

from dataclasses import dataclass

from enginelink.runtime.engine.engine_link import EngineLink
from enginelink.runtime.requests.hub import RETIRED_ENGINE_IDS_MAX, RequestHub


@dataclass
class LinkStats:
    frames_received: int
    late_outputs: int
    in_flight_max: int
    # The hub's other bounds and what they caught (runtime/requests/hub.py).
    retired_engine_ids: int
    retired_engine_ids_max: int
    renamed_calls: int
    send_errors: int
    # The gRPC side: streams one connection may carry, and the direct write path.
    max_concurrent_streams: int
    direct_writes: int
    direct_handovers: int
    # Supervision: liveness probes sent to the idle engine, their bounds, the stop's grace.
    idle_probes: int
    idle_probes_answered: int
    idle_probe_interval_seconds: float
    idle_probe_timeout_seconds: float
    engine_stop_grace_seconds: float
    # Stop strings of the calls that ended: text matched, automaton steps (<= 2 per character).
    stop_chars: int = 0
    stop_steps: int = 0
    # Calls failed because the engine's logprob arrays could not be read (the engine's fault).
    logprob_errors: int = 0
    # PD: refused decode legs sent to the engine pre-aborted, so the prefill side frees its KV.
    kv_releases: int = 0
    # Frames whose writes waited for a later frame of the same wake-up, and the wake-ups that
    # held more than one frame (RequestHub.hold_writes): a servicer behind its engine.
    held_frames: int = 0
    held_bursts: int = 0


def link_stats(link: EngineLink, hub: RequestHub, max_concurrent_streams: int) -> LinkStats:
    """``max_concurrent_streams``: the gRPC front's bound (``runtime/rpc/fastpath.py``, above this layer)."""
    sup = link.supervision
    return LinkStats(
        link.frames_received, hub.late_outputs, hub.in_flight_max,
        len(hub.retired), RETIRED_ENGINE_IDS_MAX, hub.renamed, hub.send_errors,
        max_concurrent_streams, hub.direct_writes, hub.direct_handovers,
        link.idle_probe.probes_sent, link.idle_probe.probes_answered, sup.idle_probe.interval_s, sup.idle_probe.timeout_s, sup.stop_grace_s,
        hub.stop_chars, hub.stop_steps, hub.logprob_errors, hub.kv_releases,
        hub.held_frames, hub.held_bursts,
    )


@dataclass
class ResumeStats:
    """Engine restarts and the streams they resumed (``smg_servicer_resume_*``; docs/resume.md)."""

    restarts: int  # the engine started again after a crash
    restarts_max: int  # ENGINELINK_ENGINE_RESTARTS (0: off)
    held_requests: int  # held now, waiting for the restarted engine
    resumed_requests: int  # re-submitted to a restarted engine
    resume_failed_requests: int  # failed by an engine death although restarts are on (each says why)
    reprefilled_tokens: int  # generated tokens re-sent as prompt to a restarted engine


def resume_stats(link: EngineLink, hub: RequestHub) -> ResumeStats:
    budget, core = link.restart_budget, hub.core
    return ResumeStats(
        budget.restarts if budget else 0, budget.policy.restarts_max if budget else 0,
        len(core.held), core.resumed_requests, core.resume_failures, core.reprefilled_tokens,
    )
