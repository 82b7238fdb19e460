"""The supervision every engine link runs, whatever its transport: when an engine counts as dead.

One set of watches for the ZeroMQ transport (vLLM, TokenSpeed, MLX),
SGLang's pipe and the in-memory simulation alike, so a simulation run
exercises exactly the production supervision (the reference servicer's
knobs, ``Supervision``):

- start-up (``bound_startup``): the handshake may be silent for
  ``startup_timeout_s``, extended while the engine process lives, never
  beyond ``startup_ceiling_s`` (0 = no ceiling);
- the process (``watch_process``): its exit fails the link at once (before
  the handshake, an exit 2 is the engine refusing its arguments);
- the connection (``watch_disconnect``): the transport says the engine's
  connection dropped (its engine core died while its launcher still runs);
  the process watcher gets ``DISCONNECT_GRACE_S`` to report a plain exit
  with its status first;
- silence (``watch_silence``): nothing from the engine for
  ``silence_timeout_s`` + pending prefill tokens ÷ ``prefill_tokens_per_s``
  while requests are in flight;
- idle liveness (``probe_while_idle``): an idle engine is asked a
  side-effect-free utility call (``machines/liveness.py``) on a wire that
  has one (``transport.idle_probes``).

Each watch ends by failing the link (``EngineLink.fail``) or by the link's
nursery ending; none does I/O but through the link. Time only from trio.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import assert_never

import trio

from enginelink.machines.link import LinkState
from enginelink.machines.liveness import PROBE_METHOD, IdleProbe, ProbeFailed, ProbeSend, ProbeTiming, ProbeWait
from enginelink.runtime.engine.engine_processes import ENGINE_STOP_GRACE_S
from enginelink.runtime.engine.launchers import refused_arguments

log = logging.getLogger("enginelink.link")

# When the engine drops its connection, how long the process watcher gets to
# report the exit itself (with its status) before the drop fails the link.
DISCONNECT_GRACE_S = 0.2


@dataclass(frozen=True)
class Supervision:
    """How long an engine may take, or stay quiet, before it counts as dead."""

    startup_timeout_s: float = 1800.0  # SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS
    startup_ceiling_s: float = 14400.0  # SMG_VLLM_SERVICER_STARTUP_CEILING_SECS; 0 = none
    silence_timeout_s: float = 300.0  # SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS
    prefill_tokens_per_s: float = 2000.0  # SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC
    stop_grace_s: float = ENGINE_STOP_GRACE_S  # ENGINELINK_ENGINE_STOP_GRACE_SECS
    # ENGINELINK_IDLE_PROBE_SECS / ENGINELINK_IDLE_PROBE_TIMEOUT_SECS (machines/liveness.py)
    idle_probe: ProbeTiming = ProbeTiming()

    def silence_limit_s(self, pending_prefill_tokens: int) -> float:
        return self.silence_timeout_s + pending_prefill_tokens / self.prefill_tokens_per_s


class Supervisor:
    """The watches of one link (module docstring); the link starts them, its nursery ends them."""

    def __init__(self, link, supervision: Supervision) -> None:  # link: the EngineLink it watches (which imports this)
        self.link = link
        self.supervision = supervision
        self.idle_probe = IdleProbe(supervision.idle_probe)
        self.probe_call_id: int | None = None  # the outstanding idle probe's utility call

    def new_start(self) -> None:
        """The engine starts again (a restart): an outstanding probe went with the last one."""
        self.idle_probe.sent_at = None
        self.probe_call_id = None

    def process_started(self, nursery: trio.Nursery) -> None:
        """The engine's process (or the simulation's stand-in) runs: watch it and bound its start-up."""
        nursery.start_soon(self.watch_process)
        nursery.start_soon(self.bound_startup)

    def serving(self, nursery: trio.Nursery, transport) -> None:
        """The engine is up: watch its connection, its silence and, where the wire can, its idle liveness."""
        nursery.start_soon(self.watch_disconnect, transport)
        nursery.start_soon(self.watch_silence)
        if transport.idle_probes:
            nursery.start_soon(self.probe_while_idle)

    async def bound_startup(self) -> None:
        """Bound the handshake: silence extended while the process lives, and a ceiling."""
        link, sup = self.link, self.supervision
        started = trio.current_time()
        ceiling = started + sup.startup_ceiling_s if sup.startup_ceiling_s > 0 else math.inf
        while not link.handshake_done and link.machine.live:
            deadline = min(link.progress_at + sup.startup_timeout_s, ceiling)
            await trio.sleep_until(deadline)
            if link.handshake_done or not link.machine.live:
                return
            now = trio.current_time()
            if now >= ceiling:
                link.fail(
                    f"engine did not complete the handshake within the start-up ceiling of "
                    f"{sup.startup_ceiling_s:g} s (SMG_VLLM_SERVICER_STARTUP_CEILING_SECS)"
                )
                return
            if now >= link.progress_at + sup.startup_timeout_s:
                if link.process is not None and link.process.returncode is None:
                    log.info("engine still starting after %.0f s (its process is alive): waiting on", now - started)
                    link.journal_handshake("startup_extended", {"after_s": now - started})
                else:
                    link.fail(
                        f"engine did not complete the handshake within {sup.startup_timeout_s:g} s "
                        "(SMG_VLLM_SERVICER_STARTUP_TIMEOUT_SECS)"
                    )
                    return

    async def watch_process(self) -> None:
        link = self.link
        process = link.process
        await process.wait()
        if link.machine.live and not link.stopping:
            refusal = None
            if not link.handshake_done:
                refusal = refused_arguments(process, link.facts_path, link.redactor.line)
            if refusal is not None:
                link.failure_status = 2
            link.fail(refusal or f"engine process {process.pid} exited with status {process.returncode}")

    async def watch_disconnect(self, transport) -> None:
        """The transport saw the engine's connection drop: its engine core is gone."""
        await transport.wait_disconnected()
        link = self.link
        if link.stopping:
            return
        # Let the process watcher report a plain exit with its status first.
        await trio.sleep(DISCONNECT_GRACE_S)
        if link.machine.live and not link.stopping:
            pid = link.process.pid if link.process else "?"
            link.fail(
                f"engine closed its output connection (its engine core exited) while its "
                f"launcher process {pid} still runs"
            )

    async def watch_silence(self) -> None:
        """Fail the link when the engine says nothing for too long with requests in flight."""
        link, sup = self.link, self.supervision
        check_s = max(0.05, min(1.0, sup.silence_timeout_s / 4))
        busy_since: float | None = None
        while link.machine.live:
            await trio.sleep(check_s)
            in_flight, prefill_tokens = link.load_probe()
            now = trio.current_time()
            if not in_flight:
                busy_since = None
                continue
            if busy_since is None:
                busy_since = now
            quiet_s = now - max(link.last_frame_at, busy_since)
            limit_s = sup.silence_limit_s(prefill_tokens)
            if quiet_s > limit_s:
                link.fail(
                    f"engine sent nothing for {quiet_s:.1f} s with {in_flight} requests in flight "
                    f"(limit {limit_s:.1f} s: SMG_VLLM_SERVICER_SILENCE_TIMEOUT_SECS "
                    f"+ {prefill_tokens} pending prefill tokens at SMG_VLLM_SERVICER_PREFILL_TOKENS_PER_SEC)"
                )
                return

    async def probe_while_idle(self) -> None:
        """Ask an idle engine whether it lives; fail the link when it does not answer (machines/liveness.py)."""
        link = self.link
        timing = self.supervision.idle_probe
        if timing.interval_s <= 0:
            return  # ENGINELINK_IDLE_PROBE_SECS=0: no probes
        if not getattr(link.codec, "control_calls", True):
            # A wire with no utility calls (TokenSpeed 0.1.1) has no probe to send: its engine's death
            # shows as its process exiting or ENGINE_CORE_DEAD; a frozen idle engine goes unseen until
            # a request meets the silence timeout.
            log.info("idle liveness probes off: the %s wire has no control calls to probe with", link.codec.name)
            return
        # Woken this often besides the machine's own times, to see answers and new requests.
        check_s = max(0.05, min(1.0, timing.interval_s / 4, timing.timeout_s / 4))
        while link.machine.live:
            now = trio.current_time()
            idle = link.machine.state is LinkState.SERVING and not link.load_probe()[0]
            # The quietest rank decides: every rank gets the probe, and each must answer it.
            quiet_rank, heard_at = min(link.rank_heard_at.items(), key=lambda item: item[1],
                                       default=(0, link.last_frame_at))
            match self.idle_probe.poll(now, idle=idle, last_frame_at=heard_at):
                case ProbeSend():
                    self._send_probe()
                case ProbeFailed(unanswered_s=unanswered_s):
                    who = "engine" if len(link.rank_heard_at) <= 1 else f"engine DP rank {quiet_rank}"
                    link.fail(
                        f"{who} answered no liveness probe ({PROBE_METHOD}) for {unanswered_s:.1f} s while idle "
                        f"(limit ENGINELINK_IDLE_PROBE_TIMEOUT_SECS={timing.timeout_s:g}): it is frozen or gone"
                    )
                    return
                case ProbeWait(until=until):
                    await trio.sleep_until(min(until, now + check_s))
                case unreachable:
                    assert_never(unreachable)

    def is_probe_answer(self, call_id: int) -> bool:
        return call_id == self.probe_call_id

    def _send_probe(self) -> None:
        """One probe to every rank (one call id): an idle engine is silent on every rank."""
        link = self.link
        call_id = self.probe_call_id = link.next_call_id()
        frames = link.codec.encode_utility(call_id, PROBE_METHOD, [])
        for rank in link.ranks.ranks or (0,):
            try:
                link.send(frames, rank)
            except Exception as error:  # LinkFailed, zmq errors: whatever the transport says
                # Unanswered, it fails the link at its timeout; the log says why it went unanswered.
                log.warning("idle probe not sent to DP rank %d: %s", rank, error)
