"""Engine restarts in the simulation: streams that outlive their engine (docs/resume.md).

- ``test_resume_seed``: a sweep of ``resume_scenario`` seeds (restarts on,
  engines dying at random points, now and then a poison request or an engine
  that stops coming up), every check of the simulation plus the resume
  invariant: every client stream equals the engine's tokens, none lost or
  doubled at a seam, and a resumed choice equals an uninterrupted run's
  (``checks._engine_stream``, ``checks._uninterrupted``);
- named runs, built by hand, each of one promise: four greedy streams killed
  under and resumed whole; a poison request stopping the restarts at N with
  every held stream failed naming the cause (exit 1); an engine that cannot
  start again; a request in flight at two crashes failed rather than resumed
  again; the resume timeout; a drain while restarting; restarts off.
"""

from __future__ import annotations

import pytest

from enginelink.journal import records as r
from enginelink.journal.fold import fold
from enginelink.machines.resume import ResumePolicy
from enginelink.machines.warmup import WarmupLevel
from enginelink.runtime.engine.engine_link import Supervision
from enginelink.runtime.engine.memory_link import MemoryEngineOptions
from enginelink.machines.sim_core import SimConfig
from enginelink.tools.inspect import render_state
from tests.sim.checks import _uninterrupted
from tests.sim.runner import SimRun, run_seed
from tests.sim.scenario import EOS_TOKEN_ID, FIRST_TOKEN, VOCAB_SIZE, ClientPlan, FaultPlan, Scenario, resume_scenario

PROMPT = [318, 283, 1552, 10, 90, 305]
LONG = 400  # tokens of each long stream (the sim's context: 512)


def _check(run: SimRun) -> SimRun:
    if run.violations:
        pytest.fail(run.report(), pytrace=False)
    return run


def test_resume_seed(resume_seed, sim_model):
    model, tokenizer = sim_model
    _check(run_seed(resume_seed, model, tokenizer, sc=resume_scenario(resume_seed)))


def _scenario(*, clients: list[ClientPlan], faults: list[FaultPlan], resume: ResumePolicy, horizon_s: float = 6.0,
              sigterm_at: float | None = None, engine: MemoryEngineOptions | None = None,
              step_us: float = 2000.0, seed: int = 7) -> Scenario:
    return Scenario(
        seed=seed,
        sim=SimConfig(vocab_size=VOCAB_SIZE, max_model_len=512, eos_token_id=EOS_TOKEN_ID, block_size=16,
                      num_gpu_blocks=8192, max_num_seqs=16, max_num_batched_tokens=2048, step_us=step_us),
        engine=engine or MemoryEngineOptions(startup_delay_s=0.1),
        supervision=Supervision(startup_timeout_s=3.0, startup_ceiling_s=30.0, silence_timeout_s=1.0),
        warmup_level=WarmupLevel.FAST, warmup_budget_s=5.0, drain_s=1.0, snapshot_interval_s=0.5,
        horizon_s=horizon_s, sigterm_at=horizon_s if sigterm_at is None else sigterm_at,
        clients=clients, faults=faults, resume=resume)


def _long(index: int, at: float = 0.5, *, prompt=PROMPT, stream: bool = True, **kw) -> ClientPlan:
    return ClientPlan(index=index, at=at, request_id=f"r-{index}", stream=stream, prompt=list(prompt),
                      max_tokens=kw.pop("max_tokens", LONG), ignore_eos=True, temperature=0.0, **kw)


def _tokens(obs) -> list[int]:
    chunks = [t for m in obs.messages if m.HasField("chunk") for t in m.chunk.token_ids]
    return chunks if obs.plan.stream else list(obs.messages[-1].complete.output_ids)


def _records(run: SimRun, kind: str) -> list[r.Record]:
    return [rec for rec in run.servicer.journal.records() if rec.kind == kind]


def test_four_greedy_streams_killed_under_are_resumed_whole_and_equal_an_uninterrupted_run(sim_model):
    model, tokenizer = sim_model
    # The engine is killed 0.4 s in (~200 tokens of 400 into each stream), and again once the four run on
    # the second engine: each stream crosses one seam, none a second (the second kill finds the four done).
    sc = _scenario(clients=[_long(i, stream=i != 3) for i in range(4)],  # one non-streaming call among them
                   faults=[FaultPlan(0.9, "kill")], resume=ResumePolicy(restarts_max=2))
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    sv = run.servicer
    assert sv.exit_status == 0 and sv.link.restart_budget.restarts == 1
    for obs in run.observations:
        assert obs.outcome == "ok", (obs.plan.request_id, obs.outcome, obs.error)
        tokens = _tokens(obs)
        assert len(tokens) == LONG
        assert tokens == _uninterrupted(sv, obs.admission.call.spec.specs[0])
        [resume] = obs.admission.resumes
        assert 0 < resume[0][1] < LONG  # re-prefilled: some tokens, not all
    held, resumed = _records(run, r.KIND_ENGINE_HELD), _records(run, r.KIND_ENGINE_RESUME)
    assert len(held) == len(resumed) == 4
    assert sum(sum(rec.payload["reprefilled"]) for rec in resumed) == sv.hub.core.reprefilled_tokens > 0
    [restart] = _records(run, r.KIND_ENGINE_RESTART)
    assert "exited with status -9" in restart.payload["crash"]
    link = fold(sv.journal.records()).links["vllm-0"]
    assert (link.state, link.restarts) == ("stopped", 1)
    transitions = [(rec.payload["source"], rec.payload["dest"]) for rec in _records(run, r.KIND_TRANSITION)
                   if rec.payload["machine"] == "link"]
    assert ("serving", "restarting") in transitions and ("restarting", "serving") in transitions


def test_a_poison_request_stops_the_restarts_at_n_and_fails_every_held_stream_naming_the_cause(sim_model):
    model, tokenizer = sim_model
    poison = FIRST_TOKEN
    clients = [_long(0, prompt=[poison, *PROMPT]), *(_long(i) for i in range(1, 4))]
    sc = _scenario(clients=clients, faults=[], resume=ResumePolicy(restarts_max=1),
                   engine=MemoryEngineOptions(startup_delay_s=0.1, poison_token=poison))
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    sv = run.servicer
    # The poison kills the first engine; the restart re-sends it; it kills the second: the budget (1) is spent.
    assert sv.exit_status == 1
    assert "exited with status -11" in sv.reason and "engine restarts stop: 2 crashes" in sv.reason
    assert sv.link.restart_budget.restarts == 1
    for obs in run.observations:
        assert obs.outcome == "UNAVAILABLE", (obs.plan.request_id, obs.outcome)
        assert "exited with status -11" in obs.error and "ENGINELINK_ENGINE_RESTARTS=1" in obs.error, obs.error


def test_a_poison_request_in_flight_at_two_crashes_fails_and_the_engine_serves_on(sim_model):
    model, tokenizer = sim_model
    poison = FIRST_TOKEN
    clients = [_long(0, prompt=[poison, *PROMPT]), _long(1), _long(2, at=3.0, max_tokens=50)]
    sc = _scenario(clients=clients, faults=[], resume=ResumePolicy(restarts_max=3),
                   engine=MemoryEngineOptions(startup_delay_s=0.1, poison_token=poison))
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    sv = run.servicer
    first, second, later = run.observations
    # Both were in flight at the poison's two crashes: failed, not re-sent a third time; the engine then serves.
    for obs in (first, second):
        assert obs.outcome == "UNAVAILABLE" and "in flight at 2 engine crashes" in obs.error, obs.error
    assert later.outcome == "ok" and len(_tokens(later)) == 50
    assert sv.exit_status == 0 and sv.link.restart_budget.restarts == 2


def test_an_engine_that_cannot_start_again_stops_the_restarts_at_n_and_exits_1(sim_model):
    model, tokenizer = sim_model
    sc = _scenario(clients=[_long(i) for i in range(2)], faults=[FaultPlan(0.9, "kill")],
                   resume=ResumePolicy(restarts_max=3, resume_timeout_s=60.0),
                   engine=MemoryEngineOptions(startup_delay_s=0.1, starts_ok=1))
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    sv = run.servicer
    assert sv.exit_status == 1 and "engine restarts stop: 4 crashes" in sv.reason, sv.reason
    assert sv.link.restart_budget.restarts == 3
    assert len(_records(run, r.KIND_ENGINE_RESTART)) == 3
    for obs in run.observations:
        assert obs.outcome == "UNAVAILABLE" and "engine restarts stop" in obs.error, obs.error


def test_held_streams_wait_no_longer_than_the_resume_timeout(sim_model):
    model, tokenizer = sim_model
    # A restart that takes 2 s (the engine's start-up) against a resume timeout of 0.5 s.
    sc = _scenario(clients=[_long(i, at=2.5) for i in range(2)], faults=[FaultPlan(2.9, "kill")],
                   resume=ResumePolicy(restarts_max=2, resume_timeout_s=0.5),
                   engine=MemoryEngineOptions(startup_delay_s=2.0), horizon_s=8.0)
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    for obs in run.observations:
        assert obs.outcome == "UNAVAILABLE" and "ENGINELINK_RESUME_TIMEOUT_SECS=0.5" in obs.error, obs.error
        assert obs.ended_at == pytest.approx(2.9 + 0.5, abs=0.01)
    assert run.servicer.exit_status == 0 and run.servicer.link.restart_budget.restarts == 1


def test_a_drain_while_the_engine_restarts_fails_the_held_streams_at_once(sim_model):
    model, tokenizer = sim_model
    sc = _scenario(clients=[_long(i, at=2.5) for i in range(2)], faults=[FaultPlan(2.9, "kill")],
                   resume=ResumePolicy(restarts_max=2), engine=MemoryEngineOptions(startup_delay_s=2.0),
                   sigterm_at=3.2, horizon_s=6.0)
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    for obs in run.observations:
        assert obs.outcome == "UNAVAILABLE" and "draining while its engine restarts" in obs.error, obs.error
        assert obs.ended_at == pytest.approx(3.2, abs=0.01)
    assert run.servicer.exit_status == 0


def test_with_restarts_off_an_engine_death_fails_every_stream_and_exits_1_as_before(sim_model):
    model, tokenizer = sim_model
    sc = _scenario(clients=[_long(i) for i in range(2)], faults=[FaultPlan(0.9, "kill")], resume=ResumePolicy())
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    assert run.servicer.exit_status == 1 and run.servicer.link.restart_budget is None
    assert all(obs.outcome == "UNAVAILABLE" for obs in run.observations)
    assert not _records(run, r.KIND_ENGINE_HELD) and not _records(run, r.KIND_ENGINE_RESTART)


def test_replay_and_inspect_show_a_restarting_link_its_held_streams_then_their_resumption(sim_model):
    model, tokenizer = sim_model
    # The kill at 1.4 s; the new engine takes 0.5 s to start: at 1.7 s the link restarts, the streams held.
    sc = _scenario(clients=[_long(i, at=1.0) for i in range(2)], faults=[FaultPlan(1.4, "kill")],
                   resume=ResumePolicy(restarts_max=1), engine=MemoryEngineOptions(startup_delay_s=0.5))
    run = _check(run_seed(sc.seed, model, tokenizer, sc=sc))
    records = run.servicer.journal.records()
    during = fold([rec for rec in records if rec.time <= 1.7])
    assert during.links["vllm-0"].state == "restarting"
    assert [v.held for v in during.requests.values() if v.state not in ("finished", "failed", "aborted")] == [True, True]
    shown = render_state(during)
    assert "restarting" in shown and "2 held for the restarting engine" in shown and shown.count("HELD") == 2
    after = fold(records)
    assert after.links["vllm-0"].restarts == 1
    resumed = [v for rid, v in after.requests.items() if rid.startswith("r-")]
    assert all(v.resumes == 1 and v.reprefilled > 0 and not v.held for v in resumed)
    assert "engine restarts: 1; the last after: engine process 4242 exited with status -9" in render_state(after)
