"""PD legs on the SGLang and TokenSpeed contracts: the bootstrap fields, the leg's DP rank, its pairing facts.

What the router does with such a pair (router 1.13.0 observed on loopback,
``--pd-disaggregation --prefill grpc://P BOOTSTRAP_PORT --decode grpc://D``):
it sends the same ``GenerateRequest`` (the same ``request_id``) to both legs,
each with SGLang's ``disaggregated_params{bootstrap_host, bootstrap_port,
bootstrap_room}`` (TokenSpeed's ``kv_bootstrap_info``): the prefill worker's
host, the bootstrap port registered for it, a random room; never a
``data_parallel_rank``. It streams the answer from the decode leg. At
registration it reads each leg's ``server_args`` (``disaggregation_mode``,
``dp_size``, ``load_balance_method``) and probes the prefill's bootstrap port.

What the engines need (SGLang 0.5.23, TokenSpeed 0.1.1 source):

- a request on a PD leg carries the rendezvous (host, port, room) to its
  engine (SGLang's ``TokenizedGenerateReqInput.bootstrap_*``, TokenSpeed's
  ``bootstrap_*``); a leg without them cannot run it (SGLang's DP controller
  asserts the room; the prefill side has no peer), so one is refused here;
- under data parallelism a prefill leg runs a request on the rank of its
  room's residue, ``bootstrap_room % dp_size``: SGLang's DP controller places
  it there (``follow_bootstrap_room``, the default load balancing of
  ``--disaggregation-mode prefill``) and its KV sender fails one that ran
  elsewhere ("follow_bootstrap_room conflict"); the decode side looks for the
  KV on that rank (SGLang ``decode.py`` ``_resolve_prefill_dp_rank``,
  TokenSpeed ``pd/mooncake/receiver.py``). So a prefill leg's pin yields to
  the residue, with a warning, as the reference's does; a decode leg's pin
  stands;
- SGLang's own warm-up and health probe on a leg send SGLang's stand-in host
  (``FAKE_BOOTSTRAP_HOST``, a transfer to nobody on either side) and room 0;
  the reference's planned warm-up sends the room of the rank it pins, so the
  residue places the request where the plan meant it. TokenSpeed has no such
  stand-in, and the reference plans no warm-up on its legs.

Pure functions, no I/O (one log line when a pin yields).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from enginelink.runtime.errors import ClientError

log = logging.getLogger("enginelink.pd")

NO_LEG: Final = "null"  # SGLang's and TokenSpeed's --disaggregation-mode default: a whole engine
LEG_MODES: Final = ("prefill", "decode")
# SGLang's stand-in bootstrap host (sglang/srt/disaggregation/utils.py): its fake transfer backend.
FAKE_BOOTSTRAP_HOST: Final = "2.2.2.2"
BOOTSTRAP_PORT_DEFAULT: Final = 8998  # both engines' --disaggregation-bootstrap-port default
TRANSFER_BACKEND_DEFAULT: Final = "mooncake"
FOLLOW_ROOM: Final = "follow_bootstrap_room"
HOST_BYTES_MAX: Final = 255  # a DNS name's length
ROOM_MAX: Final = 2**63 - 1
PAIRING_PROTOCOL_ENV: Final = "SMG_PAIRING_PROTOCOL"
# The facts a launch adds to the engine's ready facts (``launch_facts``), read back by ``PdLeg.of``.
FACT_MODE: Final = "disaggregation_mode"
FACT_PORT: Final = "disaggregation_bootstrap_port"
FACT_BACKEND: Final = "disaggregation_transfer_backend"
FACT_BALANCE: Final = "load_balance_method"
FACT_STAND_IN: Final = "disaggregation_stand_in_host"


def _flag(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for index, arg in enumerate(argv):
        if arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def launch_facts(codec: str, engine_args: Sequence[str]) -> dict:
    """The PD role an engine's arguments give it, as ready facts (the engines' own flags and defaults).

    ``codec`` is the engine wire (``sglang`` or ``tokenspeed``: the sim's
    personalities take the same flags); SGLang's ``--load-balance-method
    auto`` resolves as SGLang resolves it (``follow_bootstrap_room`` on a
    prefill leg, else ``round_robin``); TokenSpeed's prefill ranks always
    follow the room (its decode receiver looks at the residue)."""
    mode = _flag(engine_args, "--disaggregation-mode") or NO_LEG
    port_text = _flag(engine_args, "--disaggregation-bootstrap-port")
    try:
        port = int(port_text) if port_text is not None else BOOTSTRAP_PORT_DEFAULT
    except ValueError:
        port = BOOTSTRAP_PORT_DEFAULT  # the engine's own parser refuses it at launch
    if codec == "sglang":
        balance = _flag(engine_args, "--load-balance-method") or "auto"
        if balance == "auto":
            balance = FOLLOW_ROOM if mode == "prefill" else "round_robin"
        stand_in = FAKE_BOOTSTRAP_HOST
    else:
        balance, stand_in = FOLLOW_ROOM if mode == "prefill" else "round_robin", None
    return {FACT_MODE: mode, FACT_PORT: port,
            FACT_BACKEND: _flag(engine_args, "--disaggregation-transfer-backend") or TRANSFER_BACKEND_DEFAULT,
            FACT_BALANCE: balance, FACT_STAND_IN: stand_in}


@dataclass(frozen=True)
class PdLeg:
    """The engine's PD role, as its facts say (``launch_facts``)."""

    mode: str = NO_LEG
    bootstrap_port: int = BOOTSTRAP_PORT_DEFAULT
    transfer_backend: str = TRANSFER_BACKEND_DEFAULT
    load_balance_method: str = "round_robin"
    stand_in_host: str | None = None  # the engine's transfer to nobody (SGLang's), None where it has none

    @classmethod
    def of(cls, ready: Mapping) -> PdLeg:
        mode = str(ready.get(FACT_MODE) or NO_LEG)
        if mode == NO_LEG:
            return NO_PD
        return cls(mode=mode, bootstrap_port=int(ready.get(FACT_PORT) or BOOTSTRAP_PORT_DEFAULT),
                   transfer_backend=str(ready.get(FACT_BACKEND) or TRANSFER_BACKEND_DEFAULT),
                   load_balance_method=str(ready.get(FACT_BALANCE) or "round_robin"),
                   stand_in_host=ready.get(FACT_STAND_IN))

    @property
    def is_leg(self) -> bool:
        return self.mode in LEG_MODES

    @property
    def follows_room(self) -> bool:
        """A prefill leg whose ranks must run a request on its room's residue."""
        return self.mode == "prefill" and self.load_balance_method == FOLLOW_ROOM

    def server_fields(self) -> dict:
        """What GetServerInfo's ``server_args`` says of the role (the engines' own key names), and the
        operator's pairing protocol (``SMG_PAIRING_PROTOCOL``, trimmed; the reference's)."""
        return {FACT_MODE: self.mode, FACT_PORT: self.bootstrap_port, FACT_BACKEND: self.transfer_backend,
                FACT_BALANCE: self.load_balance_method,
                "pairing_protocol": (os.environ.get(PAIRING_PROTOCOL_ENV) or "").strip()}


NO_PD: Final = PdLeg()


def bootstrap_params(leg: PdLeg, field: str, given: bool, host: str, port: int, room: int) -> dict | None:
    """The bootstrap fields a request carries to its engine (``GenerateSpec.kv_transfer_params``), checked.

    ``given``: the request has the message (``HasField``). A whole engine
    refuses one, a leg requires one (``ClientError`` naming ``field``); port
    0 is "unset" (the reference's: ``bootstrap_port`` None when 0)."""
    if not leg.is_leg:
        if given:
            raise ClientError(field, "this worker is not a prefill/decode leg (its engine runs without "
                                     "--disaggregation-mode)")
        return None
    if not given:
        raise ClientError(field, f"this worker is a {leg.mode} leg: the bootstrap host, port and room are required")
    if not host or len(host.encode()) > HOST_BYTES_MAX or any(c.isspace() or ord(c) < 32 for c in host):
        raise ClientError(f"{field}.bootstrap_host", f"must be a host name or address of at most "
                                                     f"{HOST_BYTES_MAX} bytes, without spaces")
    if not 0 <= port <= 65535:
        raise ClientError(f"{field}.bootstrap_port", f"must be in [1, 65535] (0: unset), got {port}")
    if not 0 <= room <= ROOM_MAX:
        raise ClientError(f"{field}.bootstrap_room", f"must be >= 0, got {room}")
    return {"bootstrap_host": host, "bootstrap_port": port or None, "bootstrap_room": room}


def leg_rank(leg: PdLeg, params: dict | None, pin: int | None, dp_size: int, request_id: str) -> int | None:
    """The DP rank a request runs on: a prefill leg's room residue under data parallelism (a pin that
    differs yields to it, with a warning), else the pin (None: the servicer's own least-loaded pick)."""
    if params is None or dp_size <= 1 or not leg.follows_room:
        return pin
    residue = params["bootstrap_room"] % dp_size
    if pin is not None and pin != residue:
        log.warning("request %s: data_parallel_rank %d yields to rank %d, its bootstrap_room's residue "
                    "(a prefill leg runs a request on bootstrap_room %% dp_size, where the decode leg "
                    "looks for its KV)", request_id, pin, residue)
    return residue


def stand_in_params(leg: PdLeg, rank: int | None) -> dict | None:
    """A warm-up or health request's bootstrap on a leg, as the engine's own warm-up sends it: the
    stand-in host (a transfer to nobody) and, as room, the rank it is meant for (its residue); None
    on a whole engine, and on an engine with no stand-in (TokenSpeed)."""
    if not leg.is_leg or leg.stand_in_host is None:
        return None
    return {"bootstrap_host": leg.stand_in_host, "bootstrap_port": None, "bootstrap_room": rank or 0}
