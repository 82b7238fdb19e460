"""What must hold after (and during) every simulated run; each check returns violations as lines.

After a run (``check_run``):
- ``journal.verify`` passes on the whole journal, the run stopped, nothing open at its end;
- no call left open: the hub holds none, every admitted call is terminal,
  every handler ended;
- the journal's fold equals the live state: the link, and every request's
  state, choices, tokens sent and tokens the engine produced; the fold from
  the latest snapshot equals the fold from the start;
- the link ended as the faults dictate, with the exit status that goes with it;
- every client saw what its plan and the run explain: one ``complete`` per
  choice, tokens conserved from the engine's frames to the client (ids, not
  only counts), finish reasons that hold (length = max_tokens, stop = a stop
  string, a stop id or EOS), refusals only for bad or ill-timed calls,
  never INTERNAL;
- with engine restarts on (``resume_scenario``): every client stream equals
  the engine's tokens, none lost or doubled at a seam: what the first engine
  made up to the tokens re-prefilled, then what each later engine made for
  the continuation (``_engine_stream``); and a resumed choice equals what an
  uninterrupted sim engine makes for the request (``_uninterrupted``): the
  sim's tokens depend on the context alone, as a greedy model's do.
During a run (``check_live``): the fold of the journal so far equals the hub
and the link at that instant.
"""

from __future__ import annotations

from collections import defaultdict

from enginelink.journal import records as r
from enginelink.journal.fold import FoldState, fold
from enginelink.journal.verify import verify
from enginelink.machines.link import LINK_TABLE
from enginelink.machines.request import REQUEST_TABLE, RequestState
from enginelink.machines.sim_core import SimEngineCore
from enginelink.runtime.engine.supervision import DISCONNECT_GRACE_S
from enginelink.wire import vllm
from tests.sim.scenario import EOS_TOKEN_ID, FATAL_FAULTS
from tests.sim.servicer import LINK_NAME, Admission, Observation, SimServicer

TABLES = {"link": LINK_TABLE, "request": REQUEST_TABLE}
OPEN_STATES = {RequestState.ADMITTED.value, RequestState.RUNNING.value}
# What each fault makes the link say when it fails it.
FAILURE_WORDS = {
    "kill": ("exited with status -9",),
    "core_dead": ("ENGINE_CORE_DEAD", "exited with status 1"),
    "garbage": ("cannot read",),
    "disconnect": ("closed its output connection", "handshake within"),
    "silence": ("sent nothing",),
    "hang_startup": ("handshake within",),
    # Engine restarts (resume_scenario): a poison request's segfault, an engine that no longer comes up.
    "poison": ("exited with status -11",),
    "starts_ok": ("exited with status 1", "handshake"),
}
REFUSAL_WORDS = ("engine is starting", "warming up", "draining", "not alive", "restarting")
# What a call an engine death failed although restarts are on says (machines/request_resume.py, compose.py).
RESUME_FAILURE_WORDS = ("not resumed", "restarted engine is not reachable")
# What a link that restarts no more says, besides its last crash's words.
RESTARTS_STOP_WORDS = "engine restarts stop"



def check_live(sv: SimServicer, state: FoldState) -> list[str]:
    """The fold of every record so far against the hub and the link right now."""
    out = []
    link = state.links.get(LINK_NAME)
    live_link = sv.link.machine.state.value
    if link is None or link.state != live_link:
        out.append(f"fold says link {link.state if link else None}, the link is {live_link}")
    folded_open = {rid for rid, view in state.requests.items() if view.state in OPEN_STATES}
    if folded_open != set(sv.hub.calls):
        out.append(f"open requests: fold {sorted(folded_open)}, hub {sorted(sv.hub.calls)}")
    for rid, call in sv.hub.calls.items():
        view = state.requests.get(rid)
        if view is None:
            continue
        if view.state != call.machine.state.value:
            out.append(f"{rid}: fold state {view.state}, hub {call.machine.state.value}")
        for choice in call.choices:
            folded = view.engine_tokens[choice.index] if choice.index < len(view.engine_tokens) else None
            if folded != choice.tokens_engine and not (choice.matched_str is not None and folded > choice.tokens_engine):
                out.append(f"{rid} choice {choice.index}: fold counts {folded} engine tokens, the hub {choice.tokens_engine}")
    return out


def check_run(run) -> list[str]:
    sv: SimServicer = run.servicer
    records = sv.journal.records()
    out: list[str] = []
    out += _check_journal(sv, records)
    out += _check_nothing_open(sv, run.observations)
    out += _check_fold(sv, records)
    out += _check_link_end(sv, records)
    for obs in run.observations:
        others = [o for o in run.observations if o.plan.request_id == obs.plan.request_id and o is not obs]
        out += [f"client {obs.plan.index}.{obs.attempt} ({obs.plan.request_id!r}): {v}" for v in _check_client(sv, obs, others)]
    return out


# -- the journal -----------------------------------------------------------------------------


def _check_journal(sv: SimServicer, records: list[r.Record]) -> list[str]:
    out = []
    if not records or records[0].seq != 1:
        out.append("the ring lost the run's first records")
    report = verify(records, tables=TABLES)
    out += [f"verify: {v.check} at seq {v.seq}: {v.message}" for v in report.violations]
    if report.open_at_end:
        out.append(f"verify: open at the end: {report.open_at_end}")
    if not report.run_stopped:
        out.append("verify: no run.stop")
    if report.frames_undecodable and not any(f.kind == "garbage" and f.applied for f in sv.faults):
        out.append(f"{report.frames_undecodable} undecodable frames without a garbage fault")
    frames = sum(1 for rec in records if rec.kind == r.KIND_ENGINE_FRAME)
    # Every frame is journaled but an idle probe's bare answer (the supervision's, by design).
    journaled = sv.link.frames_received - sv.link.probe_answers
    if frames != journaled:
        out.append(f"{frames} engine.frame records, but the link received {sv.link.frames_received} frames, "
                   f"{sv.link.probe_answers} of them idle-probe answers")
    if sv.link.frames_received > sv.link.transport.frames_sent_by_engine:
        out.append(f"the link received {sv.link.frames_received} frames, the engine sent {sv.link.transport.frames_sent_by_engine}")
    stops = [rec for rec in records if rec.kind == r.KIND_RUN_STOP]
    if len(stops) != 1 or stops[0].payload["exit_status"] != sv.exit_status:
        out.append(f"run.stop records {[s.payload for s in stops]}, exit status {sv.exit_status}")
    elif stops[0].seq != records[-1].seq:
        out.append(f"records after run.stop: {[(rec.seq, rec.kind, rec.stream) for rec in records if rec.seq > stops[0].seq][:5]}")
    return out


def _check_nothing_open(sv: SimServicer, observations: list[Observation]) -> list[str]:
    out = []
    if sv.hub.calls:
        out.append(f"calls left open in the hub: {sorted(sv.hub.calls)}")
    if sv.hub.writing:
        out.append(f"ended calls whose writer never finished: {sorted(sv.hub.writing)}")
    for admission in sv.hub.admissions:
        if admission.call.machine.open:
            out.append(f"admitted call {admission.call.spec.request_id!r} (t={admission.at:.3f}) never ended")
    for obs in observations:
        if obs.started_at is not None and obs.ended_at is None:
            out.append(f"client {obs.plan.index}'s handler never ended")
    return out


# -- the fold against the live state ---------------------------------------------------------


def _check_fold(sv: SimServicer, records: list[r.Record]) -> list[str]:
    out = []
    state = fold(records)
    link = state.links.get(LINK_NAME)
    machine = sv.link.machine
    if link is None or (link.state, link.since) != (machine.state.value, machine.since):
        out.append(f"fold says link {link}, the link is {machine.state.value} since {machine.since}")
    if state.run.exit_status != sv.exit_status:
        out.append(f"fold says exit status {state.run.exit_status}, the run returned {sv.exit_status}")
    last: dict[str, Admission] = {}
    for admission in sv.hub.admissions:
        last[admission.call.spec.request_id] = admission
    for rid, admission in last.items():
        view = state.requests.get(rid)
        call = admission.call
        if view is None:
            out.append(f"admitted {rid!r} is missing from the fold")
            continue
        completed = [c for c in call.choices if c.complete_sent]
        # A call whose ADD could not be handed to the engine failed before its engine.request.
        unsent = call.error is not None and "not reachable" in str(call.error)
        engine_ids = [] if unsent else [c.engine_id for c in call.choices]
        live = (call.machine.state.value, len(call.choices), call.prompt_tokens, engine_ids,
                len(completed), sum(c.tokens_sent for c in completed))  # fmt: skip
        folded = (view.state, view.n, view.prompt_tokens, view.engine_ids, view.choices_done, view.tokens_sent)
        if live != folded:
            out.append(f"{rid}: fold (state, n, prompt, engine ids, done, sent) {folded}, live {live}")
        for choice in [] if unsent else call.choices:
            folded_tokens = view.engine_tokens[choice.index] if choice.index < len(view.engine_tokens) else -1
            cut = choice.matched_str is not None and folded_tokens >= choice.tokens_engine
            if folded_tokens != choice.tokens_engine and not cut:
                out.append(f"{rid} choice {choice.index}: fold counts {folded_tokens} engine tokens, the hub {choice.tokens_engine}")
    refused_only = {rid for rid in state.requests if rid not in last}
    if refused_only:
        out.append(f"the fold holds requests the hub never admitted: {sorted(refused_only)[:5]}")
    snapshots = [rec for rec in records if rec.kind == r.KIND_SNAPSHOT]
    if snapshots:
        resumed = fold([rec for rec in records if rec.seq > snapshots[-1].seq], FoldState.from_snapshot(snapshots[-1]))
        if resumed.to_dict() != state.to_dict():
            out.append(f"the fold from the snapshot at seq {snapshots[-1].seq} differs from the fold from the start")
    return out


# -- how the link ended ----------------------------------------------------------------------


def _check_link_end(sv: SimServicer, records: list[r.Record]) -> list[str]:
    out = []
    sc = sv.sc
    machine = sv.link.machine
    state, failure = machine.state.value, machine.failure or ""
    if state not in ("stopped", "failed"):
        return [f"the link ended {state}, neither stopped nor failed"]
    signalled = sv.reason.startswith("signal ")
    if (sv.exit_status == 0) != signalled:
        out.append(f"exit status {sv.exit_status} with reason {sv.reason!r}")
    if sv.exit_status == 1 and state != "failed":
        out.append(f"exit status 1 but the link is {state}")
    if sv.exit_status not in (0, 1):
        out.append(f"exit status {sv.exit_status}")
    applied = [f for f in sv.faults if f.applied]
    # A garbage frame sent while the link is starting waits for the receive loop, and a
    # dropped connection is watched only once the handshake is done; a drain during
    # start-up runs neither. In every other live state a fatal fault decides.
    # A dropped connection is noticed DISCONNECT_GRACE_S later, which a drain can beat.
    decisive = [
        f for f in applied
        if f.kind in FATAL_FAULTS
        and (f.link_state in ("warming_up", "serving") or (f.link_state == "starting" and f.kind in ("kill", "core_dead")))
        and not (f.kind == "disconnect" and sv.sigterm_sent_at is not None and sv.sigterm_sent_at <= f.at + DISCONNECT_GRACE_S)
    ]  # fmt: skip
    if sc.resume.enabled:
        # An engine that dies while the link serves or restarts is started again: only the budget's end fails
        # the link from there; a death where restarts do not apply (start-up, the first warm-up, a drain) as ever.
        decisive = [f for f in decisive if f.link_state not in ("serving", "restarting")]
        failed_from = [rec.payload["source"] for rec in records if rec.kind == r.KIND_TRANSITION
                       and rec.payload["machine"] == "link" and rec.payload["dest"] == "failed"]
        if failed_from and failed_from[0] in ("serving", "restarting") and RESTARTS_STOP_WORDS not in failure:
            out.append(f"the link failed ({failure!r}) from {failed_from[0]}, although it restarts the engine "
                       "and its budget was not spent")
    if decisive and state != "failed":
        out.append(f"{decisive[0].kind} at t={decisive[0].at:.3f} ({decisive[0].link_state}) but the link ended {state}")
    if state == "failed":
        causes = [f.kind for f in applied if f.kind in (*FATAL_FAULTS, "silence")]
        if sc.engine.hang_startup:
            causes.append("hang_startup")
        if sc.engine.poison_token is not None:
            causes.append("poison")
        if sc.engine.starts_ok is not None:
            causes.append("starts_ok")
        words = [w for kind in causes for w in FAILURE_WORDS[kind]]
        if not any(w in failure for w in words):
            out.append(f"the link failed ({failure!r}) but no fault explains it (faults applied: {causes})")
        if "sent nothing" in failure:
            silence = next(f for f in applied if f.kind == "silence")
            if sv.link_failed_at < silence.at + sc.supervision.silence_timeout_s:
                out.append(f"silence failure at {sv.link_failed_at:.3f}, silence began {silence.at:.3f}")
    if sc.engine.hang_startup and state == "stopped" and sv.sigterm_sent_at is not None:
        if sv.sigterm_sent_at > sc.supervision.startup_ceiling_s + 1.0:
            out.append("the engine never finished its handshake, yet the link was not failed by the ceiling")
    disconnected = any(f.kind == "disconnect" for f in applied)
    for admission in sv.hub.admissions:
        call = admission.call
        if call.machine.state is RequestState.FAILED and state != "failed":
            # A call whose ADD found the engine's connection gone fails UNAVAILABLE at once, though the
            # link notices the drop only DISCONNECT_GRACE_S later, and a drain may stop it first.
            unreachable = (disconnected and call.failure is not None and call.failure.kind == "engine"
                           and "engine is not reachable" in call.failure.message)
            # With restarts on, a death the link restarts from fails what cannot be resumed, and an ADD may
            # meet the dead engine before the link has noticed (the restart's own warm-up calls too).
            not_resumed = (sc.resume.enabled and call.failure is not None
                           and any(w in call.failure.message for w in (*RESUME_FAILURE_WORDS, "engine is not reachable")))
            if not unreachable and not not_resumed:
                out.append(f"{call.spec.request_id!r} failed, but the link did not")
    return out


# -- what each client saw ----------------------------------------------------------------------


def _check_client(sv: SimServicer, obs: Observation, others: list[Observation]) -> list[str]:
    plan = obs.plan
    adm = obs.admission
    outcome = obs.outcome
    out = []
    if outcome == "INTERNAL":
        return [f"INTERNAL: {obs.error}"]
    if outcome in (None, "unreachable"):
        return []
    if plan.bad is not None:
        if adm is not None:
            out.append(f"bad request ({plan.bad}) was admitted")
        if outcome == "UNAVAILABLE" and "starting" not in obs.error:
            out.append(f"bad request ({plan.bad}) refused UNAVAILABLE: {obs.error}")
        elif outcome not in ("INVALID_ARGUMENT", "UNAVAILABLE", "cancelled", "closed"):
            out.append(f"bad request ({plan.bad}) ended {outcome}: {obs.error}")
        return out
    if outcome == "INVALID_ARGUMENT":
        return [f"a valid request was refused: {obs.error}"]
    if outcome == "ALREADY_EXISTS":
        # Open from its admission until its handler ended (its writer took every complete).
        if not any(o.admission is not None and o.admission.at <= obs.started_at <= o.ended_at for o in others):
            out.append("refused ALREADY_EXISTS, but no call with its id was open then")
        return out
    if outcome == "UNAVAILABLE":
        if adm is None:
            if not any(w in obs.error for w in REFUSAL_WORDS):
                out.append(f"refused UNAVAILABLE: {obs.error}")
        elif adm.call.machine.state is not RequestState.FAILED:
            out.append(f"UNAVAILABLE but the call ended {adm.call.machine.state.value}")
        return out
    if outcome == "cancelled" and plan.cancel_after_s is None:
        out.append("cancelled, but its client never cancels")
    if outcome in ("cancelled", "closed"):
        return out + _check_tokens(sv, obs, partial=True)
    if outcome != "ok":
        return [f"ended {outcome}: {obs.error}"]
    if adm is None:
        return ["ended OK without being admitted"]
    return out + _check_tokens(sv, obs, partial=False)


def _check_tokens(sv: SimServicer, obs: Observation, *, partial: bool) -> list[str]:
    """Messages, completes and token ids of one call against the hub and the engine."""
    adm = obs.admission
    if adm is None:
        return []
    plan, call = obs.plan, adm.call
    out = []
    chunks: dict[int, list[list[int]]] = defaultdict(list)
    completes: dict[int, object] = {}
    for message in obs.messages:
        if message.HasField("chunk"):
            index = message.chunk.index
            if index in completes:
                out.append(f"choice {index}: a chunk after its complete")
            chunks[index].append(list(message.chunk.token_ids))
        else:
            index = message.complete.index
            if index in completes:
                out.append(f"choice {index}: two completes")
            completes[index] = message.complete
    if not plan.stream and chunks:
        out.append("chunks on a non-streaming call")
    if not partial and sorted(completes) != list(range(len(call.choices))):
        out.append(f"completes for choices {sorted(completes)} of {len(call.choices)}")
    for index, complete in completes.items():
        choice = call.choices[index]
        if plan.stream:
            tokens = [t for chunk in chunks[index] for t in chunk]
            last = chunks[index][-1] if chunks[index] else []
            if list(complete.output_ids) != last:
                out.append(f"choice {index}: the complete repeats {list(complete.output_ids)}, the last chunk was {last}")
        else:
            tokens = list(complete.output_ids)
        out += [f"choice {index}: {v}" for v in _check_choice(sv, adm, index, tokens, complete)]
        if len(tokens) != choice.tokens_sent:
            out.append(f"choice {index}: the client got {len(tokens)} tokens, the hub counted {choice.tokens_sent} sent")
    return out


def _check_choice(sv: SimServicer, adm: Admission, index: int, tokens: list[int], complete) -> list[str]:
    out = []
    call = adm.call
    spec = call.spec
    sampling = spec.specs[index].sampling
    reason = complete.finish_reason
    engine = _engine_stream(sv, adm, index)
    if len(tokens) > spec.max_tokens:
        out.append(f"{len(tokens)} tokens, max_tokens {spec.max_tokens}")
    if engine is not None and tokens != engine[: len(tokens)]:
        seam = _first_difference(tokens, engine)
        out.append(f"tokens {tokens[:8]}... are not what the engine produced for this ADD {engine[:8]}... "
                   f"(first difference at {seam}; resumed at {[r[index][1] for r in adm.resumes if index in r]})")
    if any(index in resume for resume in adm.resumes):
        reference = _uninterrupted(sv, spec.specs[index])
        if tokens != reference[: len(tokens)]:
            out.append(f"resumed: tokens differ from an uninterrupted run's at {_first_difference(tokens, reference)} "
                       f"(resumed at {[r[index][1] for r in adm.resumes if index in r]})")
    whole = engine is not None and tokens == engine
    match reason:
        case "length":
            if len(tokens) != spec.max_tokens:
                out.append(f"finish length after {len(tokens)} tokens, max_tokens {spec.max_tokens}")
            if not whole:
                out.append("finish length, but the engine produced other tokens")
        case "stop":
            if complete.HasField("matched_stop_str"):
                if complete.matched_stop_str not in spec.stop_strings:
                    out.append(f"matched stop string {complete.matched_stop_str!r} was never asked for")
            elif complete.HasField("matched_token_id"):
                if not tokens or tokens[-1] != complete.matched_token_id or tokens[-1] not in sampling.stop_token_ids:
                    out.append(f"matched stop id {complete.matched_token_id}, tokens end {tokens[-3:]}")
            elif sampling.ignore_eos or not tokens or tokens[-1] != EOS_TOKEN_ID:
                out.append(f"finish stop without a match, tokens end {tokens[-3:]}")
            if not complete.HasField("matched_stop_str"):
                if not whole:
                    out.append("finish stop, but the engine produced other tokens")
                if len(tokens) < sampling.min_tokens:
                    out.append(f"stopped after {len(tokens)} tokens, min_tokens {sampling.min_tokens}")
        case "abort":
            if call.machine.state is not RequestState.ABORTED:
                out.append(f"finish abort, but the call ended {call.machine.state.value}")
        case "error":
            if tokens:
                out.append(f"finish error with {len(tokens)} tokens")
        case _:
            out.append(f"finish reason {reason!r}")
    return out


# -- engine restarts ---------------------------------------------------------------------------


def _engine_stream(sv: SimServicer, adm: Admission, index: int) -> list[int] | None:
    """The tokens the engines made for one choice, as the client must have them: the first ADD's up to the
    tokens its first resume re-prefilled, then each continuation's up to the next resume's, then the last
    one's whole. None when the choice's first ADD never reached the engine."""
    engine_tokens = sv.link.transport.engine_tokens
    if index >= len(adm.add_seqs):
        return None
    segments = [(adm.add_seqs[index], 0)] + [resume[index] for resume in adm.resumes if index in resume]
    if len(segments) == 1:
        return engine_tokens.get(adm.add_seqs[index])
    # With resumes, an ADD the engine never read (it died with the ADD on the wire) made nothing.
    stream: list[int] = []
    for (seq, start), following in zip(segments, [*segments[1:], None]):
        made = engine_tokens.get(seq, [])
        if len(stream) != start:  # the continuation's prompt must hold exactly what came before it
            return [-1] * len(stream)  # no stream can match: the seam lost or doubled tokens
        stream += made if following is None else made[: following[1] - start]
    return stream


def _uninterrupted(sv: SimServicer, spec) -> list[int]:
    """What a sim engine that never died makes for ``spec`` (alone: the sim's tokens do not depend on the batch)."""
    core = SimEngineCore(sv.sc.sim)
    frames = vllm.VllmCodec().encode_add(spec)
    now, tokens = 0.0, []
    messages = core.handle_input(frames[0], frames[1], now)
    for _ in range(4 * sv.sc.sim.max_model_len + 16):
        for message in messages:
            batch = vllm.decode_outputs(message)
            for output in batch.outputs:
                if output.request_id == spec.request_id:
                    tokens += output.new_token_ids
                    if output.finish_reason is not None:
                        return tokens
        if not core.has_work:
            break
        messages, cost_s = core.step(now)
        now += cost_s
    return tokens


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) <= len(b) else len(b)
