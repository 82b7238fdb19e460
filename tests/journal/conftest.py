"""Shared journal test helpers: a deterministic scenario of servicer events.

The scenario is what a servicer run would journal (run start, a link coming
up, requests admitted, frames, choices completing, aborts, failures, the run
stopping), generated from a seed so any failure replays exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from enginelink.journal import records as r

Event = tuple[float, str, str, object]  # (time, stream, kind, payload)


def scenario_events(seed: int, requests: int = 60) -> list[Event]:
    rng = random.Random(seed)
    t = 0.0
    out: list[Event] = []

    def ev(stream: str, kind: str, payload: object) -> None:
        nonlocal t
        t += rng.choice((0.0, 0.001, 0.01, 0.25))
        out.append((t, stream, kind, payload))

    def transition(machine: str, id_: str, source: str, dest: str, event: str) -> None:
        stream = r.link_stream(id_) if machine == "link" else r.request_stream(id_)
        ev(stream, r.KIND_TRANSITION, r.Transition(machine, id_, source, dest, event).payload())

    ev(r.RUN_STREAM, r.KIND_RUN_START, {
        "wall_time": 1_700_000_000.5, "trio_time": 0.0, "pid": 4242,
        "argv": ["enginelink", "serve"], "version": "0.1.0", "budgets": {"ring_records_max": 100},
    })
    transition("link", "0", "new", "starting", "launch")
    ev(r.link_stream("0"), r.KIND_ENGINE_HANDSHAKE, {"step": "priority", "message": {
        "levels": 10, "nice": 10, "autogroup_nice": 10, "servicer": {"policy": "batch", "threads": 4}}})
    facts = {"max_model_len": 2048, "dp": [0, 1]}
    ev(r.engine_stream(0), r.KIND_ENGINE_FACTS, {"link": "0", "pid": 777, "facts": facts})
    transition("link", "0", "starting", "warming_up", "ready")
    transition("link", "0", "warming_up", "serving", "warmed")
    live: dict[str, list[int]] = {}  # request id -> [choices left, state index]
    made = 0
    while made < requests or live:
        action = rng.random()
        if made < requests and (action < 0.3 or not live):
            rid = f"r{made:04d}"
            made += 1
            n = rng.choice((1, 1, 2, 3))
            ev(r.request_stream(rid), r.KIND_CLIENT_GENERATE, {
                "request_id": rid, "n": n, "prompt_tokens": rng.randint(1, 500),
                "stream": True, "max_tokens": 64,
            })
            transition("request", rid, "new", "admitted", "admit")
            live[rid] = [n]
        elif action < 0.6:
            ev(r.engine_stream(0), r.KIND_ENGINE_FRAME, rng.randbytes(rng.randint(8, 200)))
        else:
            rid = rng.choice(sorted(live))
            roll = rng.random()
            if roll < 0.1:
                transition("request", rid, "admitted", "aborting", "abort")
                transition("request", rid, "aborting", "aborted", "engine_done")
                del live[rid]
            elif roll < 0.15:
                transition("request", rid, "admitted", "failed", "engine_error")
                del live[rid]
            else:
                live[rid][0] -= 1
                ev(r.request_stream(rid), r.KIND_CLIENT_SENT, {
                    "request_id": rid, "index": live[rid][0], "tokens_sent": rng.randint(1, 64),
                    "finish_reason": rng.choice(("stop", "length"))})
                if live[rid][0] == 0:
                    transition("request", rid, "admitted", "finished", "complete")
                    del live[rid]
    transition("link", "0", "serving", "draining", "sigterm")
    ev(r.RUN_STREAM, r.KIND_RUN_STOP, {"exit_status": 0, "reason": "sigterm"})
    return out


@pytest.fixture
def scenario() -> Callable[..., list[Event]]:
    return scenario_events
