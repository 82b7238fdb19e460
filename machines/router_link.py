"""The router link of ``enginelink headless``: this servicer as an engine on the router's direct ZMQ lane.

In ``smg serve --connection-mode zmq`` the router binds and the engine dials
(``wire/sglang_router.py`` has the lane's messages). enginelink stands where
the engine's own plugin stands: it dials the router once its engine link
serves, and from then on relays the router's requests through the request
hub to the engine and the engine's outputs back as the lane's columns.

States (``journal/states.py`` ``RouterLinkState``): ``waiting`` (the engine
is not serving: nothing dialled, so the router keeps the worker pending) →
``dialing`` (HELLO sent) → ``registered`` (INIT read; READY and the ready
response sent: requests flow) → ``closed`` (the servicer stops) or
``failed`` (an INIT that names no addresses, the router not answering).

Sans-io: ``dial`` and ``on_init`` return the frames to send and the
transitions made; the shell sends and journals them. The table is the truth:
an event it does not allow (a second INIT, a request before registration)
is a ``ProtocolError`` naming the machine, state and event.
"""

from __future__ import annotations

from enum import StrEnum

from enginelink.journal.records import MACHINE_ROUTER, Transition
from enginelink.journal.states import ROUTER_LINK_INITIAL, ROUTER_LINK_TERMINAL, RouterLinkState
from enginelink.machines.table import build_table
from enginelink.wire import sglang_router as lane
from enginelink.wire import vllm


class RouterEvent(StrEnum):
    DIAL = "dial"
    INIT = "init"
    CLOSE = "close"
    FAIL = "fail"


_LIVE = [RouterLinkState.WAITING, RouterLinkState.DIALING, RouterLinkState.REGISTERED]

ROUTER_LINK_TABLE = build_table(
    MACHINE_ROUTER,
    states=[s.value for s in RouterLinkState],
    transitions=[
        (RouterEvent.DIAL, RouterLinkState.WAITING, RouterLinkState.DIALING),
        (RouterEvent.INIT, RouterLinkState.DIALING, RouterLinkState.REGISTERED),
        (RouterEvent.CLOSE, list(_LIVE), RouterLinkState.CLOSED),
        (RouterEvent.FAIL, list(_LIVE), RouterLinkState.FAILED),
    ],
    initial=ROUTER_LINK_INITIAL,
    terminal=ROUTER_LINK_TERMINAL,
)


class Registration:
    """What INIT gave the link: the router's data addresses, and the frames that register the engine."""

    def __init__(self, inputs: str, outputs: str, ready: bytes, ready_response: bytes) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.ready = ready  # READY, on the handshake socket
        self.ready_response = ready_response  # the first message on the input DEALER


class RouterLink:
    """One engine index's link to the router (``name``: ``router-<index>``)."""

    def __init__(self, engine_index: int, ready_response: lane.ReadyResponse) -> None:
        self.engine_index = engine_index
        self.identity = lane.identity(engine_index)
        self.name = f"router-{engine_index}"
        self.state = ROUTER_LINK_INITIAL
        self.ready_response = ready_response
        self.failure: str | None = None

    def _step(self, event: RouterEvent) -> Transition:
        dest = RouterLinkState(ROUTER_LINK_TABLE.next_state(self.name, self.state.value, event.value))
        transition = Transition(MACHINE_ROUTER, self.name, self.state.value, dest.value, event.value)
        self.state = dest
        return transition

    def dial(self) -> tuple[bytes, Transition]:
        """HELLO, sent on the handshake DEALER (identity ``self.identity``)."""
        transition = self._step(RouterEvent.DIAL)
        return lane.encode_status("HELLO"), transition

    def on_init(self, payload: bytes) -> tuple[Registration | None, Transition]:
        """The router's INIT: the registration to send, or None (and ``failed``) when it names no addresses.
        An INIT that cannot be read at all raises ``WireError`` (the router's fault)."""
        init = vllm.decode_handshake_init(payload)
        if not init.addresses.inputs or not init.addresses.outputs:
            self.failure = f"the router's INIT named no data addresses: {init.addresses}"
            return None, self._step(RouterEvent.FAIL)
        transition = self._step(RouterEvent.INIT)
        return Registration(init.addresses.inputs[0], init.addresses.outputs[0], lane.encode_status("READY"),
                            lane.encode_ready_response(self.ready_response)), transition

    def close(self) -> Transition | None:
        return self._step(RouterEvent.CLOSE) if self.live else None

    def fail(self, reason: str) -> Transition | None:
        if not self.live:
            return None
        self.failure = reason
        return self._step(RouterEvent.FAIL)

    @property
    def live(self) -> bool:
        return self.state not in ROUTER_LINK_TERMINAL

    @property
    def registered(self) -> bool:
        return self.state is RouterLinkState.REGISTERED
